//! Binds calls between the fake driver's own functions locally, as the real
//! libcuda does, so the shim's exports do not capture the driver's internals.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
}
