//! The `headroom` command (without MPI: see `crates/trainer-mpi` for `train --dist mpi`).

fn main() -> std::process::ExitCode {
    headroom_trainer::cli::main_with(&headroom_trainer::cli::CliHooks::default())
}
