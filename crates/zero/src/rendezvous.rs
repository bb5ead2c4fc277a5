//! How the processes of a job find each other without MPI: each one's place from the
//! launcher's environment ([`launched_rank`]: `mpirun`, `srun`, `torchrun`), and a 128-byte id
//! (NCCL's unique id) handed from rank 0 to the others through a file on a shared file system
//! ([`exchange_id`]). Always compiled, so both run and are tested without a GPU; the NCCL
//! collective (feature `cuda`) is what they serve.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::collective::CommKind;
use crate::error::CommError;

/// Bytes of the id the ranks exchange (NCCL's `ncclUniqueId`).
pub const ID_BYTES: usize = 128;

fn backend(message: impl Into<String>) -> CommError {
    CommError::Backend {
        source: message.into().into(),
    }
}

/// This process's place in a job a launcher started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchedRank {
    /// Its rank, `0..world`.
    pub rank: usize,
    /// The job's process count.
    pub world: usize,
    /// Its rank among the job's processes on this machine, where the launcher says.
    pub local: Option<usize>,
}

/// The launchers' variables, first match wins: (rank, world size, local rank). Open MPI's
/// `mpirun`, MPICH/Hydra's, Slurm's `srun`, and torchrun's (which DeepSpeed's launcher sets
/// too).
const LAUNCHERS: [(&str, &str, &str); 4] = [
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
];

/// This process's rank, world size and local rank from the first launcher whose rank and
/// size variables are both set (`env` reads one variable; pass `|k| std::env::var(k).ok()`).
/// A value that is not a number, a world of 0, a rank outside it, or no launcher at all is an
/// error that names the variables.
pub fn launched_rank(env: impl Fn(&str) -> Option<String>) -> Result<LaunchedRank, CommError> {
    let number = |var: &str, value: String| -> Result<usize, CommError> {
        value
            .trim()
            .parse::<usize>()
            .map_err(|_| backend(format!("{var}={value:?} is not a rank or process count")))
    };
    for (rank_var, size_var, local_var) in LAUNCHERS {
        let (Some(rank), Some(world)) = (env(rank_var), env(size_var)) else {
            continue;
        };
        let (rank, world) = (number(rank_var, rank)?, number(size_var, world)?);
        if world == 0 {
            return Err(backend(format!("{size_var} is 0")));
        }
        if rank >= world {
            return Err(backend(format!(
                "{rank_var}={rank} is not a rank of {size_var}={world} processes"
            )));
        }
        let local = env(local_var).map(|v| number(local_var, v)).transpose()?;
        return Ok(LaunchedRank { rank, world, local });
    }
    let names: Vec<String> = LAUNCHERS
        .iter()
        .map(|(r, s, _)| format!("{r}/{s}"))
        .collect();
    Err(backend(format!(
        "no launcher's rank in the environment (looked for {}): start one process per rank \
         with mpirun, srun or torchrun",
        names.join(", ")
    )))
}

/// Write `id` to `path` through a temporary file renamed into place, so that a reader never
/// sees part of it.
pub fn publish_id(path: &Path, id: &[u8; ID_BYTES]) -> Result<(), CommError> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, id)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| backend(format!("writing the id to {}: {e}", path.display())))
}

/// Wait at most `timeout` for `path` to appear, then read the id from it (a file of another
/// size is an error).
pub fn wait_for_id(path: &Path, timeout: Duration) -> Result<[u8; ID_BYTES], CommError> {
    let start = Instant::now();
    loop {
        match std::fs::read(path) {
            Ok(bytes) => {
                return bytes.as_slice().try_into().map_err(|_| {
                    backend(format!(
                        "{}: {} bytes, an id has {ID_BYTES}",
                        path.display(),
                        bytes.len()
                    ))
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if start.elapsed() > timeout {
                    return Err(CommError::Timeout {
                        op: CommKind::Broadcast,
                        waited: start.elapsed(),
                        missing: vec![0],
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(backend(format!("{}: {e}", path.display()))),
        }
    }
}

/// The job's id: rank 0 makes it (`make`) and publishes it at `path`; every other rank waits
/// at most `timeout` for the file and reads it. Rank 0 refuses a file already there — an
/// earlier job's id, which the others could read before the new one replaced it — so remove
/// it (rank 0 does, through [`retire_id`], once every rank has joined).
pub fn exchange_id(
    rank: usize,
    path: &Path,
    timeout: Duration,
    make: impl FnOnce() -> Result<[u8; ID_BYTES], CommError>,
) -> Result<[u8; ID_BYTES], CommError> {
    if rank != 0 {
        return wait_for_id(path, timeout);
    }
    if path.exists() {
        return Err(backend(format!(
            "{} already exists: an earlier job's id? Remove it and start every rank again",
            path.display()
        )));
    }
    let id = make()?;
    publish_id(path, &id)?;
    Ok(id)
}

/// Rank 0, once every rank has joined: remove the id file, so the next job does not find it.
/// A file already gone is not an error.
pub fn retire_id(path: &Path) -> Result<(), CommError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(backend(format!("removing {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn each_launcher_is_read_and_the_first_wins() {
        let open_mpi = env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
        ]);
        assert_eq!(
            launched_rank(open_mpi).unwrap(),
            LaunchedRank {
                rank: 2,
                world: 4,
                local: Some(0)
            }
        );
        let hydra = env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]);
        assert_eq!(
            launched_rank(hydra).unwrap(),
            LaunchedRank {
                rank: 1,
                world: 2,
                local: None
            }
        );
        let slurm = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "1"),
        ]);
        assert_eq!(launched_rank(slurm).unwrap().local, Some(1));
        let torchrun = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]);
        assert_eq!(
            launched_rank(torchrun).unwrap(),
            LaunchedRank {
                rank: 0,
                world: 1,
                local: Some(0)
            }
        );
        // A rank without a size is not a launcher's: the next one is read.
        let partial = env(&[("SLURM_PROCID", "1"), ("RANK", "1"), ("WORLD_SIZE", "2")]);
        assert_eq!(launched_rank(partial).unwrap().world, 2);
    }

    #[test]
    fn bad_or_missing_values_are_errors_that_name_them() {
        let message = |vars: &[(&str, &str)]| launched_rank(env(vars)).unwrap_err().to_string();
        assert!(message(&[]).contains("OMPI_COMM_WORLD_RANK"));
        assert!(message(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(message(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("not a rank of"));
        assert!(message(&[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE is 0"));
        assert!(
            message(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")])
                .contains("LOCAL_RANK")
        );
    }

    fn scratch_dir(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("headroom-rendezvous-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn rank_0_publishes_and_the_others_read_the_same_id() {
        let dir = scratch_dir("exchange");
        let path = dir.join("nccl-id");
        let mut id = [0u8; ID_BYTES];
        id.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i as u8).wrapping_mul(29) ^ 0x5a);
        let readers: Vec<_> = (1..4)
            .map(|rank| {
                let path = path.clone();
                std::thread::spawn(move || {
                    exchange_id(rank, &path, Duration::from_secs(10), || {
                        panic!("only rank 0 makes the id")
                    })
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            exchange_id(0, &path, Duration::from_secs(10), || Ok(id)).unwrap(),
            id
        );
        for r in readers {
            assert_eq!(r.join().unwrap().unwrap(), id);
        }
        // A leftover file: rank 0 refuses it, and after retiring it makes a new one.
        let again = exchange_id(0, &path, Duration::from_secs(1), || Ok(id));
        assert!(again.unwrap_err().to_string().contains("already exists"));
        retire_id(&path).unwrap();
        retire_id(&path).unwrap();
        assert!(exchange_id(0, &path, Duration::from_secs(1), || Ok(id)).is_ok());
        // Rank 0's failure to make an id is passed on, and publishes nothing.
        retire_id(&path).unwrap();
        let failed = exchange_id(0, &path, Duration::from_secs(1), || {
            Err(backend("libnccl missing"))
        });
        assert!(failed.unwrap_err().to_string().contains("libnccl missing"));
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_or_malformed_id_file_is_an_error_not_a_hang() {
        let dir = scratch_dir("missing");
        let waited = exchange_id(
            1,
            &dir.join("never"),
            Duration::from_millis(120),
            || unreachable!(),
        );
        assert!(
            matches!(waited, Err(CommError::Timeout { .. })),
            "{waited:?}"
        );
        std::fs::write(dir.join("short"), [1u8; 7]).unwrap();
        let short = wait_for_id(&dir.join("short"), Duration::from_secs(1));
        assert!(short.unwrap_err().to_string().contains("7 bytes"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
