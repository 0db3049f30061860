//! Datasets in an S3-compatible object store (AWS S3, MinIO, R2, GCS's S3 API, ...), read
//! with ranged GETs through the `object_store` crate (Apache Arrow's), which brings the
//! standard AWS configuration and retries with backoff and jitter for timeouts, 5xx,
//! throttling and cut connections (crate::storage says where bytes come from). Built with
//! the `s3` feature, which the Python extension turns on.
//!
//! Configuration is the standard AWS one, as the AWS CLI and boto3 read it:
//! - the environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//!   `AWS_REGION` / `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` (a non-AWS server),
//!   `AWS_ALLOW_HTTP=true` (a plain-HTTP endpoint), `AWS_SKIP_SIGNATURE=true` (a public
//!   bucket), read by object_store;
//! - where the environment names no access key, the shared files (`~/.aws/credentials`,
//!   `~/.aws/config`, `AWS_PROFILE`): their credentials (keys, SSO, `credential_process`,
//!   roles), `region` and `endpoint_url`, read by the AWS SDK's own loader (aws-config),
//!   whose chain then goes on to web identity, containers and the instance's role.
//!   object_store reads no shared files: without this, `aws configure`'s keys went unseen.
//!
//! Nothing that holds a secret is ever printed: errors name the object and the frame.
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use aws_config::meta::region::ProvideRegion;
use aws_config::profile::ProfileFileRegionProvider;
use aws_config::BehaviorVersion;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use bytes::Bytes;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, AwsCredential};
use object_store::path::Path as ObjectPath;
use object_store::{CredentialProvider, ObjectStore, ObjectStoreExt};

use crate::error::{Error, Result};
use crate::storage::{is_remote, REMOTE_SCHEMES};

/// A dataset's directory in an object store.
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    /// The directory's key prefix inside the bucket.
    prefix: String,
    /// The URL as given, for messages.
    url: String,
}

/// One runtime for every remote read of the process: requests are started from the
/// loader's worker threads (plain threads) with `block_on`, several in flight at once.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("object-store")
            .enable_all()
            .build()
            .expect("a tokio runtime for object storage")
    })
}

/// `builder` (object_store's reading of the environment) with what the AWS SDK's loader
/// finds in the shared config files: its credentials chain, and the profile's `region` and
/// `endpoint_url` where the environment sets none. The region is given to the loader (the
/// environment's, the profile's, else us-east-1, as object_store defaults), so that loading
/// never waits on the instance metadata service to learn one.
fn with_shared_config(mut builder: AmazonS3Builder) -> AmazonS3Builder {
    let from_env = |key| builder.get_config_value(&key);
    let (region, endpoint) = (
        from_env(AmazonS3ConfigKey::Region),
        from_env(AmazonS3ConfigKey::Endpoint),
    );
    let sdk = runtime().block_on(async {
        let region = match region {
            Some(r) => Some(aws_config::Region::new(r)),
            None => ProfileFileRegionProvider::new().region().await,
        };
        let region = region.unwrap_or(aws_config::Region::from_static("us-east-1"));
        aws_config::defaults(BehaviorVersion::latest())
            .region(region)
            .load()
            .await
    });
    if let Some(region) = sdk.region() {
        builder = builder.with_region(region.as_ref());
    }
    if let (None, Some(url)) = (endpoint, sdk.endpoint_url()) {
        builder = builder.with_endpoint(url);
    }
    if let Some(provider) = sdk.credentials_provider() {
        builder = builder.with_credentials(Arc::new(SdkCredentials {
            provider,
            cached: Mutex::new(None),
        }));
    }
    builder
}

/// The AWS SDK's credentials chain as object_store's credential provider. object_store asks
/// before every request; the chain may call out (SSO, STS, a process), so a credential is
/// kept until five minutes before it expires.
#[derive(Debug)]
struct SdkCredentials {
    provider: SharedCredentialsProvider,
    cached: Mutex<Option<(Arc<AwsCredential>, Option<SystemTime>)>>,
}

/// Why the SDK's chain gave no credentials, in one line: where it looked, where none was
/// found; else the chain's own reason (a profile that does not parse, an SSO login
/// that expired, a failing `credential_process`) with its causes, on one line.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct NoCredentials(String);

impl NoCredentials {
    fn from_sdk(e: &CredentialsError) -> Self {
        let looked = if let CredentialsError::CredentialsNotLoaded(_) = e {
            let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
            format!(
                "none in the environment, in profile '{profile}' of ~/.aws/credentials and \
                 ~/.aws/config, or from web identity, a container or the instance"
            )
        } else {
            let mut why = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(inner) = source {
                why = format!("{why}: {inner}");
                source = inner.source();
            }
            why.split_whitespace().collect::<Vec<_>>().join(" ")
        };
        NoCredentials(format!(
            "no AWS credentials ({looked}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
             a profile's keys in ~/.aws/credentials (AWS_PROFILE names it), or \
             AWS_SKIP_SIGNATURE=true for a public bucket"
        ))
    }
}

#[async_trait::async_trait]
impl CredentialProvider for SdkCredentials {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        let fresh = |expiry: &Option<SystemTime>| {
            expiry.is_none_or(|t| t > SystemTime::now() + Duration::from_secs(300))
        };
        if let Some((credential, expiry)) = &*self.cached.lock().unwrap_or_else(|e| e.into_inner())
        {
            if fresh(expiry) {
                return Ok(Arc::clone(credential));
            }
        }
        let got = self.provider.provide_credentials().await.map_err(|e| {
            object_store::Error::Generic {
                store: "S3",
                source: Box::new(NoCredentials::from_sdk(&e)),
            }
        })?;
        let credential = Arc::new(AwsCredential {
            key_id: got.access_key_id().to_string(),
            secret_key: got.secret_access_key().to_string(),
            token: got.session_token().map(str::to_string),
        });
        *self.cached.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Arc::clone(&credential), got.expiry()));
        Ok(credential)
    }
}

impl Remote {
    /// `url`: `s3://bucket/prefix` (the dataset's directory).
    pub fn open(url: &str) -> Result<Arc<Self>> {
        let url = url.trim_end_matches('/').to_string();
        let rest = REMOTE_SCHEMES
            .iter()
            .find_map(|s| url.strip_prefix(s))
            .ok_or_else(|| Error::InvalidArgument(format!("{url}: not an s3:// URL")))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
            && builder
                .get_config_value(&AmazonS3ConfigKey::SkipSignature)
                .is_none_or(|v| v != "true")
        {
            builder = with_shared_config(builder);
        }
        let store = builder.build().map_err(|e| Error::Remote {
            object: url.clone(),
            detail: format!("cannot configure S3 access: {e}"),
        })?;
        Ok(Arc::new(Remote {
            store: Arc::new(store),
            prefix: prefix.to_string(),
            url,
        }))
    }

    fn key(&self, name: &str) -> ObjectPath {
        if self.prefix.is_empty() {
            ObjectPath::from(name)
        } else {
            ObjectPath::from(format!("{}/{name}", self.prefix))
        }
    }

    /// The URL of object `name` of this directory (for messages).
    pub fn url_of(&self, name: &str) -> String {
        format!("{}/{name}", self.url)
    }

    fn err(&self, name: &str, what: &str, e: object_store::Error) -> Error {
        let detail = match e {
            object_store::Error::NotFound { .. } => format!("{what}: no such object"),
            other => format!("{what}: {other}"),
        };
        Error::Remote {
            object: self.url_of(name),
            detail,
        }
    }

    /// The whole object `name`.
    pub fn get(&self, name: &str) -> Result<Vec<u8>> {
        self.get_if_present(name)?.ok_or_else(|| Error::Remote {
            object: self.url_of(name),
            detail: "reading it: no such object".into(),
        })
    }

    /// The whole object `name`, or None where there is no such object.
    pub fn get_if_present(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let key = self.key(name);
        let got = runtime().block_on(async {
            let r = self.store.get(&key).await?;
            r.bytes().await
        });
        match got {
            Ok(b) => Ok(Some(b.into())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(name, "reading it", e)),
        }
    }

    /// Bytes `range` of object `name` (`what` says which part, for messages): the response
    /// body's buffer itself, not a copy.
    pub fn get_range(&self, name: &str, range: Range<u64>, what: &str) -> Result<Bytes> {
        let key = self.key(name);
        let want = range.end - range.start;
        let got = runtime()
            .block_on(self.store.get_range(&key, range))
            .map_err(|e| self.err(name, what, e))?;
        if got.len() as u64 != want {
            return Err(Error::Remote {
                object: self.url_of(name),
                detail: format!("{what}: got {} bytes, asked for {want}", got.len()),
            });
        }
        Ok(got)
    }

    /// Uploads the local file `path` as object `name` of this directory: one PUT for a
    /// small file, a multipart upload (16 MiB parts, several in flight) for a large one;
    /// either way the object appears whole or not at all.
    pub fn put_file(&self, name: &str, path: &std::path::Path) -> Result<()> {
        use std::io::Read;
        const PART: usize = 16 << 20;
        let key = self.key(name);
        let len = std::fs::metadata(path)
            .map_err(|e| Error::io(path, e))?
            .len();
        runtime().block_on(async {
            if len <= PART as u64 {
                let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
                let r = self.store.put(&key, bytes.into()).await;
                return r.map(|_| ()).map_err(|e| self.err(name, "writing it", e));
            }
            let upload = (self.store.put_multipart(&key).await)
                .map_err(|e| self.err(name, "starting its upload", e))?;
            let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, PART);
            let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            let mut buf = vec![0u8; PART];
            loop {
                let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
                if n == 0 {
                    break;
                }
                // At most 4 parts in flight: memory stays bounded for any file size.
                (writer.wait_for_capacity(4).await)
                    .map_err(|e| self.err(name, "uploading a part", e))?;
                writer.write(&buf[..n]);
            }
            (writer.finish().await)
                .map(|_| ())
                .map_err(|e| self.err(name, "finishing its upload", e))
        })
    }
}

/// Uploads the dataset directory `dir` to the object-storage directory `url`: every file,
/// the manifest last, so that a reader sees the dataset whole or not at all.
pub fn upload_dataset(dir: &std::path::Path, url: &str) -> Result<()> {
    let remote = Remote::open(url)?;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_file() && name != crate::dataset::MANIFEST {
            names.push(name);
        }
    }
    names.sort();
    names.push(crate::dataset::MANIFEST.to_string());
    for name in names {
        remote.put_file(&name, &dir.join(&name))?;
    }
    Ok(())
}

/// File `name` of the dataset directory `location` (a local path or an s3:// URL), or None
/// where it has no such file: small files beside the shards (the tokenizer), for tools
/// that would otherwise need a second way into the store.
pub fn read_file(location: &str, name: &str) -> Result<Option<Vec<u8>>> {
    if is_remote(location) {
        return Remote::open(location)?.get_if_present(name);
    }
    let path = std::path::Path::new(location).join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&path, e)),
    }
}
