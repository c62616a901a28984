// Re-run the build when a migration changes, so `sqlx::migrate!` embeds the current set.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
