//! ONNX Runtime: one environment per process, loaded from the PyPI wheel's library, and
//! sessions on the CPU or CUDA execution provider.

use std::path::PathBuf;
use std::sync::OnceLock;

use ort::session::Session;

use crate::assets;
use crate::error::{Error, Result};

/// Where the learner's graphs run.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// the CPU execution provider
    Cpu,
    /// the CUDA execution provider; an error when it cannot be registered
    Cuda,
    /// CUDA when it can be registered, else the CPU (with one warning line)
    Auto,
}

static ENV: OnceLock<std::result::Result<(ort::environment::Environment, PathBuf), String>> =
    OnceLock::new();

/// The ONNX Runtime library: `TURNWISE_ORT_LIB`, else the verified copy from the
/// `onnxruntime` wheel (fetched on first use).
///
/// # Errors
/// Provisioning errors.
pub fn library_path(quiet: bool) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("TURNWISE_ORT_LIB") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            return Err(Error::Ort(format!(
                "TURNWISE_ORT_LIB={} does not exist",
                p.display()
            )));
        }
        return Ok(p);
    }
    assets::ensure(
        &assets::asset(assets::ONNXRUNTIME)?,
        &assets::cache_dir(),
        quiet,
    )
}

/// Initialises the process-wide ONNX Runtime environment (once) and returns the library path.
///
/// # Errors
/// [`Error::Ort`] when the library cannot be found or loaded.
pub fn init(quiet: bool) -> Result<PathBuf> {
    let r = ENV.get_or_init(|| {
        let path = library_path(quiet).map_err(|e| e.to_string())?;
        let builder = ort::init_from(&path)
            .map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", path.display()))?;
        let env = builder
            .with_name("turnwise")
            .build()
            .map_err(|e| format!("cannot create the ONNX Runtime environment: {e}"))?;
        Ok((env, path))
    });
    match r {
        Ok((_, p)) => Ok(p.clone()),
        Err(e) => Err(Error::Ort(e.clone())),
    }
}

/// Creates a session for a serialised model on `device` with `threads` intra-op threads.
/// Returns the session and the device it actually runs on.
///
/// # Errors
/// [`Error::Ort`]: the model is rejected, or `Device::Cuda` cannot be registered.
pub fn session(model: &[u8], device: Device, threads: usize) -> Result<(Session, Device)> {
    init(true)?;
    let env = match ENV.get() {
        Some(Ok((env, _))) => env,
        _ => return Err(Error::Ort("ONNX Runtime is not initialised".into())),
    };
    let e = |what: &'static str| move |err: ort::Error| Error::Ort(format!("{what}: {err}"));
    let build = |cuda: bool| -> Result<Session> {
        let mut b = Session::builder(env).map_err(e("session builder"))?;
        // no spin-waiting: the learner shares the cores with llama.cpp's threads (the server's
        // background updates, the demo), and spinning pools oversubscribe them to a crawl
        b = b
            .with_intra_threads(threads.max(1))
            .map_err(|x| e("threads")(x.into()))?
            .with_intra_op_spinning(false)
            .map_err(|x| e("spinning")(x.into()))?;
        if cuda {
            let ep = ort::ep::CUDA::default().build().error_on_failure();
            b = b
                .with_execution_providers([ep])
                .map_err(|x| e("CUDA execution provider")(x.into()))?;
        }
        b.commit_from_memory(model)
            .map_err(e("loading the step graph"))
    };
    match device {
        Device::Cpu => Ok((build(false)?, Device::Cpu)),
        Device::Cuda => build(true)
            .map(|s| (s, Device::Cuda))
            .map_err(|err| Error::Ort(format!("{err}. The CUDA provider needs TURNWISE_ORT_LIB pointing at libonnxruntime.so from the onnxruntime-gpu wheel, and the CUDA 12 runtime and cuDNN 9 libraries on the library path"))),
        Device::Auto => match build(true) {
            Ok(s) => Ok((s, Device::Cuda)),
            Err(err) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| tracing::warn!("CUDA execution provider unavailable ({err}); using the CPU"));
                Ok((build(false)?, Device::Cpu))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{Dim, Elem, Graph};

    fn tiny() -> Vec<u8> {
        let mut g = Graph::new(Elem::F32);
        let x = g.input("x", &[Dim::Fixed(2)], false);
        let y = g.exp(x);
        g.output(y, "y");
        g.to_bytes()
    }

    /// The CPU wheel has no CUDA provider: `cuda` must fail and say what is missing, `auto`
    /// must fall back to the CPU.
    #[test]
    fn cuda_fails_clearly_and_auto_falls_back_to_cpu() {
        let (_, used) = session(&tiny(), Device::Cpu, 1).unwrap();
        assert_eq!(used, Device::Cpu);
        match session(&tiny(), Device::Cuda, 1) {
            Err(e) => assert!(e.to_string().contains("onnxruntime-gpu"), "{e}"),
            Ok((_, used)) => {
                assert_eq!(used, Device::Cuda, "a machine with a working CUDA provider")
            }
        }
        let (_, used) = session(&tiny(), Device::Auto, 1).unwrap();
        assert!(matches!(used, Device::Cpu | Device::Cuda));
    }
}
