//! The `fine-settler` binary: everything lives in the library; see `fine_settler::cli`.

fn main() -> std::process::ExitCode {
    fine_settler::cli::main()
}
