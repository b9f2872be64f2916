//! Compiles the kubelet APIs in this directory (device plugin, pod resources,
//! DRA and DRA resource health, plugin registration) into `OUT_DIR` with a
//! vendored `protoc`, so a fresh machine needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Always use the vendored compiler: a system protoc may be missing or too old.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let protos = [
        "deviceplugin/v1beta1/api.proto",
        "podresources/v1/api.proto",
        "dra/v1/api.proto",
        "dra/v1beta1/api.proto",
        "dra-health/v1alpha1/api.proto",
        "pluginregistration/v1/api.proto",
    ];
    tonic_prost_build::configure().compile_protos(&protos, &["."])?;
    // DRA health v1 shares package `v1` with pod resources: prost writes one
    // file per package, so it gets a directory of its own.
    let health_v1 = "dra-health/v1/api.proto";
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("dra-health");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_protos(&[health_v1], &["."])?;
    for proto in protos.iter().chain([&health_v1]) {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
