//! Integration tests against the real default model, real SQLite files and the real binary.
//! All areas build into this one test binary (one shared engine).

mod common;

mod block;
mod cli;
mod demo;
mod format;
mod learn;
mod policy;
mod server;
mod store;
