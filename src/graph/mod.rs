//! The learner's compute graphs: ONNX protobuf written in Rust, differentiated by a small
//! reverse-mode builder, run by ONNX Runtime on the CPU or CUDA execution provider.

pub mod block;
pub mod builder;
pub mod onnx;
pub mod runtime;
pub mod step;

pub use builder::{Dim, Elem, Graph, V};
pub use runtime::Device;
