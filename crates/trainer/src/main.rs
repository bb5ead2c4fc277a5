//! The `headroom` command without MPI: `train --dist mpi` is handed to `headroom-mpi`
//! (`crates/trainer-mpi`).

fn main() -> std::process::ExitCode {
    headroom_trainer::cli::main_with(&headroom_trainer::cli::CliHooks::default())
}
