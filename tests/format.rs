//! The default model's converted format: llama.cpp's quantizer run once at provisioning,
//! deterministic, cached with its checksum, and recorded with every adapter and update.

use std::process::Stdio;

use turnwise::assets::{self, ModelFormat};
use turnwise::policy::gguf::GgufIndex;
use turnwise::policy::llama::{self, FileType};
use turnwise::Store;

use crate::common::*;

fn shipped() -> std::path::PathBuf {
    assets::resolve_model_as(None, ModelFormat::Shipped, true).expect("shipped model")
}

fn file_type(path: &std::path::Path) -> String {
    let idx = GgufIndex::open(path).unwrap();
    llama::ftype_name(idx.meta_f64("general.file_type").unwrap() as u32)
}

#[test]
fn converting_the_default_model_is_deterministic_cached_and_loads() {
    let src = shipped();
    let sha = assets::asset(assets::DEFAULT_MODEL).unwrap().sha256;
    let (a, b) = (tempdir(), tempdir());
    let ty = assets::DEFAULT_CONVERTED_TYPE;
    let ca = assets::convert_cached(&src, &sha, ty, Some(a.path()), true).unwrap();
    let cb = assets::convert_cached(&src, "", ty, Some(b.path()), true).unwrap();
    assert_eq!(ca.sha256, cb.sha256, "same input, same bytes");
    assert_eq!(ca.bytes, cb.bytes);
    assert_eq!(cb.source_sha256, sha, "the source is hashed when not given");
    assert_eq!(assets::sha256_file(&ca.path, None).unwrap(), ca.sha256);
    assert_eq!(ty, FileType::IQ4_NL_M);
    assert_eq!(file_type(&ca.path), "IQ4_NL");
    assert_eq!(file_type(&src), "Q4_1");
    assert_eq!(assets::model_stamp(&ca.path).unwrap().file_type, "IQ4_NL_M");
    // the block weights are IQ4_NL but ffn_down (Q4_K); the tied output / embedding keeps
    // llama.cpp's Q8_0
    let idx = GgufIndex::open(&ca.path).unwrap();
    for t in &idx.tensors {
        let got = llama::ggml_type_name(t.ggml_type);
        let want = match t.name.as_str() {
            "token_embd.weight" => "q8_0",
            n if n.contains("ffn_down") => "q4_K",
            _ if t.dims.len() == 2 => "iq4_nl",
            _ => "f32",
        };
        assert_eq!(got, want, "{}", t.name);
    }
    // a second call reuses the cached file
    let modified = std::fs::metadata(&ca.path).unwrap().modified().unwrap();
    let again = assets::convert_cached(&src, &sha, ty, Some(a.path()), true).unwrap();
    assert_eq!(again, ca);
    assert_eq!(
        std::fs::metadata(&ca.path).unwrap().modified().unwrap(),
        modified
    );
    // a truncated cache file is converted again, to the same bytes
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&ca.path)
        .unwrap();
    f.set_len(ca.bytes / 2).unwrap();
    drop(f);
    let redone = assets::convert_cached(&src, &sha, ty, Some(a.path()), true).unwrap();
    assert_eq!(redone.sha256, ca.sha256);
    assert_eq!(std::fs::metadata(&ca.path).unwrap().len(), ca.bytes);
    // no temporary file is left behind
    let left: Vec<_> = std::fs::read_dir(a.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".part"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // llama.cpp loads it
    llama::init_backend(false);
    let m = llama::Model::load(&ca.path, 0).unwrap();
    assert_eq!(m.n_embd(), 576);
}

#[test]
fn a_file_that_is_not_a_model_is_refused_by_convert_with_a_clear_error() {
    let dir = tempdir();
    let bad = dir.path().join("notes.gguf");
    std::fs::write(&bad, b"these are not weights").unwrap();
    let out = turnwise(&dir.path().join("x.db"))
        .args(["convert", bad.to_str().unwrap(), "--type", "q4_0"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", show(&out));
    assert!(show(&out).contains("notes.gguf"), "{}", show(&out));
    let out = turnwise(&dir.path().join("x.db"))
        .args(["convert", bad.to_str().unwrap(), "--type", "q3_z"])
        .output()
        .unwrap();
    assert!(
        !out.status.success() && show(&out).contains("unknown type"),
        "{}",
        show(&out)
    );
}

#[test]
fn adapters_and_updates_record_the_model_file_the_policy_ran_on() {
    let model = model_path();
    let stamp = assets::model_stamp(&model).unwrap();
    if stamp.origin.starts_with("converted") {
        // a mix of ours is named by the conversion's stamp, not by the file's main type
        assert_eq!(stamp.file_type, assets::DEFAULT_CONVERTED_TYPE.name());
        assert!(stamp.source_sha256.is_some());
    } else {
        assert_eq!(stamp.file_type, file_type(&model));
    }
    assert_eq!(stamp.sha256, assets::sha256_file(&model, None).unwrap());
    let dir = tempdir();
    let mut store = Store::open(&dir.path().join("m.db")).unwrap();
    store.set_policy_model(&assets::model_stamp_json(&model));
    let id = store
        .register_adapter(None, |id| format!("/nowhere/{id}"))
        .unwrap();
    let u = store
        .record_update(
            Some(id),
            "grpo",
            &serde_json::json!({}),
            &serde_json::json!({}),
            turnwise::UpdateStatus::Rejected,
        )
        .unwrap();
    let rec = store.adapter(id).unwrap();
    let m = rec.model.expect("adapter row names its model");
    assert_eq!(m["sha256"], stamp.sha256.as_str());
    assert_eq!(m["file_type"], stamp.file_type.as_str());
    let row: String = store
        .connection()
        .query_row("SELECT model FROM updates WHERE id = ?1", [u], |r| r.get(0))
        .unwrap();
    let row: serde_json::Value = serde_json::from_str(&row).unwrap();
    assert_eq!(row["file"], stamp.file.as_str());
}
