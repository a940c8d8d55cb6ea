//! Model files whose hyperparameters would break the first forward (a
//! division by zero, an index past the end) are refused at load, naming
//! the field: the llama fixture with its config.json edited.

use std::path::{Path, PathBuf};

use braid_ops::cpu::Cpu;
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/llama")
}

/// The fixture folder copied with `edit` applied to its config.json.
fn edited(name: &str, edit: impl Fn(&mut Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-hyper-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

fn refused(name: &str, edit: impl Fn(&mut Value)) -> String {
    let dir = edited(name, edit);
    let r = braid_models::open(&Cpu::new(Some(1)), &dir);
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Ok(_) => panic!("{name}: the broken model loaded"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn the_fixture_itself_loads() {
    braid_models::open(&Cpu::new(Some(1)), &fixture()).expect("the llama fixture loads");
}

#[test]
fn broken_hyperparameters_are_refused_naming_the_field() {
    let cases: [(&str, &str, Value, &str); 6] = [
        ("heads0", "num_attention_heads", 0.into(), "num_attention_heads) is 0"),
        ("kvheads3", "num_key_value_heads", 3.into(), "num_key_value_heads) is 3, which does not divide"),
        ("layers0", "num_hidden_layers", 0.into(), "num_hidden_layers) is 0"),
        ("eps", "rms_norm_eps", (-1.0).into(), "rms_norm_eps) is -1"),
        ("ctx0", "max_position_embeddings", 0.into(), "max_position_embeddings) is 0"),
        ("headdim0", "head_dim", 0.into(), "head_dim) is 0"),
    ];
    for (name, key, v, want) in cases {
        let e = refused(name, |c| c[key] = v.clone());
        assert!(e.contains(want), "{name}: {e}");
        assert!(e.contains("invalid"), "{name}: {e}");
    }
    // No head_dim and no heads: the default head_dim divides by the heads.
    let e = refused("nohd", |c| {
        c.as_object_mut().unwrap().remove("head_dim");
        c["num_attention_heads"] = 0.into();
    });
    assert!(e.contains("num_attention_heads) is 0"), "{e}");
}
