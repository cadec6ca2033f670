//! The `vllm-cpu` format against a real vLLM: a tiny seeded Llama runs once in vLLM's CPU
//! build (scripts/vllm/probe_kv.py, through a probe KV connector that dumps the blocks vLLM
//! wrote), and the model's own K and V come from `transformers` on the same prompt. Every
//! (layer, token, head, dim) value must sit where the format of the attention path vLLM took
//! says: layer tensors at the format's layer offsets in the one buffer, each head's K and V
//! halves at the format's head offsets (inside them, the path's own order, docs/vllm.md),
//! and on the `vec` path V rows at the format's token offsets.
//!
//! Needs the vLLM venv (`scripts/vllm/install`, run by scripts/test), named by
//! `KVFERRY_VLLM_PYTHON`; without it the test fails and says how to install it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kvferry::layout::{Dtype, KvFormat, KvLayout, ModelSpec};
use serde::Deserialize;

#[derive(Deserialize)]
struct LayerInfo {
    name: String,
    offset: usize,
    shape: Vec<usize>,
}

#[derive(Deserialize)]
struct Extent {
    offset: usize,
    len: usize,
    file_offset: usize,
}

#[derive(Deserialize)]
struct Reference {
    file: String,
}

#[derive(Deserialize)]
struct Manifest {
    dtype: String,
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    layers: Vec<LayerInfo>,
    tokens: usize,
    block_ids: Vec<usize>,
    extents: Vec<Extent>,
    reference: Reference,
    #[serde(default)]
    vllm_version: String,
    #[serde(default)]
    cpu_attention_path: String,
}

/// vLLM's buffer as far as the dump holds it.
struct Dump {
    /// Start offset -> (length, offset in kv.bin).
    extents: BTreeMap<usize, (usize, usize)>,
    bytes: Vec<u8>,
}

impl Dump {
    /// The element of `dtype` at `offset`, as f32.
    fn value_at(&self, offset: usize, dtype: Dtype) -> f32 {
        match dtype {
            Dtype::Fp32 => {
                f32::from_le_bytes(self.bytes_at(offset, 4).try_into().expect("4 bytes"))
            }
            // bf16 is the high half of an f32.
            _ => {
                let b = self.bytes_at(offset, 2);
                f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
            }
        }
    }

    /// The `n` bytes of vLLM's buffer at `offset`, from the extent that holds them.
    fn bytes_at(&self, offset: usize, n: usize) -> &[u8] {
        let (&start, &(len, at)) = self
            .extents
            .range(..=offset)
            .next_back()
            .unwrap_or_else(|| panic!("offset {offset} precedes every dumped extent"));
        assert!(
            offset + n <= start + len,
            "offset {offset} is outside the dumped extents (nearest {start}+{len})"
        );
        &self.bytes[at + offset - start..at + offset - start + n]
    }
}

fn run(python: &str, args: &[&str]) {
    let t = Instant::now();
    let out = Command::new(python)
        .args(args)
        .env("VLLM_HOST_IP", "127.0.0.1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap_or_else(|e| panic!("{python} {args:?}: {e}"));
    println!("{} took {:.1} s", args[0], t.elapsed().as_secs_f64());
    assert!(
        out.status.success(),
        "{python} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn probe(dir: &Path, extra: &[&str]) -> (Manifest, Dump, Vec<f32>) {
    let python = std::env::var("KVFERRY_VLLM_PYTHON").unwrap_or_else(|_| {
        panic!(
            "KVFERRY_VLLM_PYTHON is not set: run scripts/vllm/install (scripts/test does) and \
             point KVFERRY_VLLM_PYTHON at the venv's python"
        )
    });
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (model, out) = (dir.join("model"), dir.join("dump"));
    let script = |name: &str| root.join("scripts/vllm").join(name);
    run(
        &python,
        &[
            script("tiny_model.py").to_str().expect("utf-8"),
            model.to_str().expect("utf-8"),
        ],
    );
    let probe = script("probe_kv.py");
    let mut args = vec![
        probe.to_str().expect("utf-8"),
        model.to_str().expect("utf-8"),
        out.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(extra);
    run(&python, &args);
    let read = |name: &str| {
        std::fs::read(out.join(name))
            .unwrap_or_else(|e| panic!("{}: {e}", out.join(name).display()))
    };
    let manifest: Manifest = serde_json::from_slice(&read("manifest.json")).expect("manifest");
    let dump = Dump {
        extents: manifest
            .extents
            .iter()
            .map(|e| (e.offset, (e.len, e.file_offset)))
            .collect(),
        bytes: read("kv.bin"),
    };
    let reference = read(&manifest.reference.file)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    (manifest, dump, reference)
}

/// Where vLLM's CPU attention path keeps element (slot `s`, dim `d`) inside a (block, head)
/// half of `b` slots x `d_n` dims, K then V: measured (docs/vllm.md) and opaque to kvferry,
/// which moves a head's halves whole; the test uses it to find each value inside the slice the
/// format locates.
fn in_half(path: &str, plane: usize, s: usize, d: usize, b: usize, d_n: usize) -> usize {
    match (path, plane) {
        ("vec", 0) => d * b + s,
        ("vec", _) => s * d_n + d,
        ("amx", 0) => (s / 16) * 16 * d_n + (d / 2) * 32 + (s % 16) * 2 + d % 2,
        ("amx", _) => (d / 16) * 16 * b + (s / 2) * 32 + (d % 16) * 2 + s % 2,
        (other, _) => panic!("no in-block order known for vLLM's CPU path {other}"),
    }
}

/// Runs vLLM in `dtype` and checks that the format of the path vLLM took locates every value.
fn check(dtype_arg: &str) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("kvferry-vllm-{dtype_arg}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (m, dump, reference) = probe(&dir, &["--dtype", dtype_arg]);
    let path = m
        .cpu_attention_path
        .strip_prefix("CPU_ATTN:")
        .unwrap_or_else(|| panic!("unknown attention path {:?}", m.cpu_attention_path))
        .to_owned();
    println!(
        "vLLM {} ({}, {}): {} layers, {} KV heads, head dim {}, block size {}, {} blocks, {} tokens in blocks {:?}",
        m.vllm_version,
        m.cpu_attention_path,
        m.dtype,
        m.num_layers,
        m.num_kv_heads,
        m.head_dim,
        m.block_size,
        m.num_blocks,
        m.tokens,
        m.block_ids
    );
    let (dtype, tolerance) = match m.dtype.as_str() {
        "fp32" => (Dtype::Fp32, 1e-3),
        "bf16" => (Dtype::Bf16, 5e-2),
        other => panic!("unexpected dtype {other}"),
    };
    let model = ModelSpec::mha(m.num_layers, m.num_kv_heads, m.head_dim, dtype);
    let format = KvFormat::named(&format!("vllm-cpu-{path}")).expect("a format for the path");
    let layout = KvLayout::new(model, m.block_size)
        .expect("layout")
        .with_format(&format)
        .expect("vllm-cpu layout");
    let (bs, d, h_n, unit) = (m.block_size, m.head_dim, m.num_kv_heads, dtype.bytes());
    assert_eq!(
        layout.num_regions(),
        1,
        "vLLM CPU keeps every layer in one buffer"
    );
    assert!(m.tokens > bs, "the prompt spans more than one block");
    assert_ne!(m.tokens % bs, 0, "the prompt's last block is partial");
    assert!(
        !m.block_ids.contains(&0),
        "vLLM never hands out its null block 0"
    );
    // The layers: one buffer, layer after layer, at the format's offsets.
    for (l, info) in m.layers.iter().enumerate() {
        assert_eq!(
            info.shape,
            vec![m.num_blocks, h_n, bs, 2 * d],
            "{}: vLLM's per-layer view",
            info.name
        );
        let (region, offset) = layout.plane_location(l, 0, m.num_blocks).expect("location");
        assert_eq!(
            (region, offset),
            (0, info.offset),
            "{}: layer offset",
            info.name
        );
    }
    let stride = layout.page_stride().expect("stride");
    let (mut worst, mut checked, mut misses) = (0f32, 0usize, 0usize);
    let close = |got: f32, want: f32| (got - want).abs() <= tolerance + tolerance * want.abs();
    for l in 0..m.num_layers {
        for plane in 0..2 {
            let (_, base) = layout
                .plane_location(l, plane, m.num_blocks)
                .expect("location");
            for h in 0..h_n {
                for t in 0..m.tokens {
                    // The head's half of this block, where the format says it is.
                    let slice = base + m.block_ids[t / bs] * stride + layout.element_offset(0, h);
                    for dim in 0..d {
                        let want =
                            reference[(((l * 2 + plane) * h_n + h) * m.tokens + t) * d + dim];
                        let offset = slice + in_half(&path, plane, t % bs, dim, bs, d) * unit;
                        let got = dump.value_at(offset, dtype);
                        assert!(
                            close(got, want),
                            "layer {l} plane {plane} head {h} token {t} dim {dim}: vLLM wrote {got} at {offset}, the model's value is {want}"
                        );
                        if path == "vec" && plane == 1 {
                            // On the vec path V rows are where the format puts tokens.
                            let row = base
                                + m.block_ids[t / bs] * stride
                                + layout.element_offset(t % bs, h);
                            assert_eq!(row + dim * unit, offset, "V token row of token {t}");
                        }
                        worst = worst.max((got - want).abs());
                        checked += 1;
                        // The same value read as if the half were [slot][dim]: must differ for
                        // K on both paths, so the check can tell orders apart.
                        if plane == 0 {
                            let wrong = slice + ((t % bs) * d + dim) * unit;
                            misses += usize::from(!close(dump.value_at(wrong, dtype), want));
                        }
                    }
                }
            }
        }
    }
    let k_values = m.num_layers * h_n * m.tokens * d;
    println!(
        "{checked} values located by --kv-format {}, max abs error {worst:e}; K read as [slot][dim] misses {misses} of {k_values}",
        format.name
    );
    // bf16's wider tolerance lets more values near zero match by chance (89% misses seen).
    assert!(
        misses * 10 > k_values * 8,
        "K read in the wrong order should miss almost everywhere: {misses} of {k_values}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// float32: vLLM's `vec` path, the `vllm-cpu-vec` format.
#[test]
fn the_vllm_cpu_vec_format_locates_every_value_vllm_wrote_in_float32() {
    check("float32");
}

/// bfloat16: vLLM's `amx` path on CPUs with AMX (this machine's kind), `vec` elsewhere; the
/// format of the path it took locates every value.
#[test]
fn the_vllm_cpu_format_of_the_path_vllm_takes_locates_every_value_in_bfloat16() {
    check("bfloat16");
}
