# gpumem image: the plugin binary and the shim, built for old glibc.
#
#   docker build --build-arg GPUMEM_COMMIT=$(git rev-parse --short=12 HEAD) \
#     -t registry.example.com/gpumem:0.2.0 .
#
# CI builds the same image without Docker: .ci/build-image.py (README,
# "Deploying it").
#
# The shim is loaded into every process of capped containers, whose images
# go back to glibc 2.17 (CentOS 7): it is linked against glibc 2.17 with
# cargo-zigbuild and checked with shim/check-abi, as CI does.

# The builder's Rust is the workspace's rust-version, the declared minimum
# (.ci/check-msrv.py keeps the two equal).
FROM rust:1.89-bookworm AS build
# ziglang goes into a virtual environment of its own, not into Debian's
# externally managed Python; cargo-zigbuild runs `python -m ziglang` with the
# Python CARGO_ZIGBUILD_PYTHON_PATH names.
ENV CARGO_ZIGBUILD_PYTHON_PATH=/opt/zig/bin/python
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv binutils \
    && python3 -m venv /opt/zig \
    && /opt/zig/bin/python -m pip install --no-cache-dir 'ziglang==0.13.0' \
    && cargo install --locked cargo-zigbuild@0.24.1
WORKDIR /src
COPY . .
# The commit `gpumem --version`, /status and gpumem_build_info name:
# .dockerignore leaves .git out, so build.rs reads it from here.
ARG GPUMEM_COMMIT=unknown
RUN cargo build --locked --release -p gpumem --no-default-features \
    && cargo zigbuild --locked --release -p gpumem-shim --target x86_64-unknown-linux-gnu.2.17 \
    && shim/check-abi target/x86_64-unknown-linux-gnu/release/libgpumem_shim.so \
    && mkdir -p /out \
    && cp target/release/gpumem target/x86_64-unknown-linux-gnu/release/libgpumem_shim.so /out/

# Small runtime: glibc for the plugin (NVML is loaded from the host driver
# by the NVIDIA container runtime), nothing else.
FROM gcr.io/distroless/cc-debian12
COPY --from=build /out/gpumem /out/libgpumem_shim.so /opt/gpumem/
# `gpumem` by name, as in `kubectl -n kube-system exec ds/gpumem -- gpumem
# inspect -d`; the rest is the usual PATH. The manifests name
# /opt/gpumem/gpumem in full (.ci/validate-manifests.py resolves both).
ENV PATH=/opt/gpumem:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENTRYPOINT ["/opt/gpumem/gpumem"]
CMD ["plugin"]
