//! Binds the library's references to its own functions inside itself
//! (-Bsymbolic): the addresses of our hooks must be ours even if another
//! preloaded library exports the same names.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
}
