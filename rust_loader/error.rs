//! One error type for the whole crate. Every variant names what a person needs to
//! find the problem: the file, the shard, the frame, the manifest field.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A shard whose bytes do not match what its index or checksum promise.
    #[error("corrupt shard {shard}{}: {detail}", frame.map(|f| format!(" frame {f}")).unwrap_or_default())]
    CorruptShard {
        shard: String,
        frame: Option<usize>,
        detail: String,
    },
    /// The manifest is missing, unreadable, or disagrees with the shards.
    #[error("manifest {path}: {detail}")]
    Manifest { path: PathBuf, detail: String },
    /// A saved loader state that does not fit this dataset or configuration.
    #[error("cannot load loader state: {0}")]
    State(String),
    /// An object of a remote dataset that could not be read (after the object store's
    /// retries): the object's URL, the part (frame, index) and why; never a credential.
    #[error("{object}: {detail}")]
    Remote { object: String, detail: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A bug: a panic caught at a thread or binding boundary.
    #[error("internal error in the loader (please report): {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn corrupt(shard: &str, frame: Option<usize>, detail: impl Into<String>) -> Self {
        Error::CorruptShard {
            shard: shard.to_string(),
            frame,
            detail: detail.into(),
        }
    }
}

/// Turns a caught panic payload into an error message.
pub fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
