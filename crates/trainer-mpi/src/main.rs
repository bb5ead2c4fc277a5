//! The `headroom` command with MPI: every subcommand of `headroom`, and `train --zero S --dist
//! mpi` runs one ZeRO rank per process of an `mpirun` job (Open MPI through
//! headroom-zero-mpi). MPI is initialised the first time a rank connects and finalised when the
//! command ends, so the other subcommands run as they do without MPI.

use std::cell::OnceCell;
use std::process::ExitCode;
use std::time::Duration;

use headroom_trainer::cli::{main_with, CliHooks};
use headroom_zero::{Collective, CommError};
use headroom_zero_mpi::{initialize, MpiCollective, Universe};

fn main() -> ExitCode {
    let universe: OnceCell<Universe> = OnceCell::new();
    let code = {
        let connect = |timeout: Duration| -> Result<Box<dyn Collective>, CommError> {
            if universe.get().is_none() {
                let _ = universe.set(initialize()?);
            }
            let u = universe.get().ok_or(CommError::ThreadLost)?;
            Ok(Box::new(MpiCollective::world(u, timeout)?))
        };
        main_with(&CliHooks {
            mpi: Some(&connect),
        })
    };
    // MPI_Finalize, after every communicator (and its worker thread) is gone.
    drop(universe);
    code
}
