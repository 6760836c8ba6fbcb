"""The table of hostile inputs: checkpoints, configs, command lines, and
cache and trace files. Plain data, read by ``test_hostile_inputs.py`` (to name the cases)
and by ``_hostile_driver.py`` (which runs them under a memory limit).

A ``cli`` case runs ``opmux <argv>`` (``{ckpt}`` is a fresh copy of a tiny checkpoint with
``ckpt`` damage applied, ``{scratch}`` an empty folder that must stay empty) and must end
with exit status ``code`` and one stderr line containing ``expect``. A ``tuned``,
``trace`` or ``stamp`` case writes ``content`` where opmux reads that cache file and must
give exactly one ``RuntimeWarning`` containing ``expect`` and naming the file, with op calls
still working.
"""

from __future__ import annotations

from typing import Any

Case = dict[str, Any]

_BIG = [10**12, 2**31, 2**63, 10**30]
_NOT_INT = [True, 1.5, "8", [], {}]
_INT_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "max_position_embeddings"]
_GEN = ["generate", "--model", "{ckpt}", "--max-tokens", "2", "--prompt-ids", "1,2,3"]


def _config_cases() -> list[Case]:
    cases: list[Case] = []
    for field in _INT_FIELDS:
        for value in [0, -1, *_BIG[:2], *_NOT_INT]:
            cases.append({"id": f"config-{field}={value!r}", "kind": "cli",
                          "ckpt": {"config": {field: value}}, "argv": _GEN,
                          "expect": "config.json"})
    for field in ("num_key_value_heads", "head_dim"):
        for value in [0, -3, 3, 10**12, True, 2.5]:
            cases.append({"id": f"config-{field}={value!r}", "kind": "cli",
                          "ckpt": {"config": {field: value}}, "argv": _GEN,
                          "expect": "config.json"})
    for field in ("rms_norm_eps", "rope_theta"):
        for raw in ["0", "-1", "NaN", "Infinity", "-Infinity", "true", "\"x\"", "1e400"]:
            cases.append({"id": f"config-{field}={raw}", "kind": "cli",
                          "ckpt": {"config_raw_field": [field, raw]}, "argv": _GEN,
                          "expect": "config.json"})
    for name, value in [("rope_scaling-list", {"rope_scaling": [1, 2]}),
                        ("rope_scaling-str", {"rope_scaling": "linear"}),
                        ("rope-factor-neg", {"rope_scaling": {"rope_type": "linear",
                                                              "factor": -2}}),
                        ("rope-factor-str", {"rope_scaling": {"rope_type": "linear",
                                                              "factor": "2"}}),
                        ("rope_parameters-list", {"rope_parameters": [3]}),
                        ("eos-huge", {"eos_token_id": 10**30}),
                        ("eos-negative", {"eos_token_id": -1}),
                        ("eos-float", {"eos_token_id": 1.5}),
                        ("eos-vocab", {"eos_token_id": 64}),
                        ("eos-list-str", {"eos_token_id": ["a"]}),
                        ("arch-unknown", {"architectures": ["GPT9"]}),
                        ("arch-number", {"architectures": 5}),
                        ("arch-nested", {"architectures": [["LlamaForCausalLM"]]}),
                        ("act-relu", {"hidden_act": "relu"}),
                        ("tie-str", {"tie_word_embeddings": "yes"}),
                        ("kv-exceeds", {"num_key_value_heads": 8}),
                        ("heads-3-hidden-32", {"num_attention_heads": 3,
                                               "num_key_value_heads": 3, "head_dim": None})]:
        cases.append({"id": f"config-{name}", "kind": "cli", "ckpt": {"config": value},
                      "argv": _GEN, "expect": "config.json"})
    for name, raw in [("list", "[1, 2]"), ("string", "\"x\""), ("number", "3"),
                      ("empty", ""), ("truncated", "{\"architectures\": ["),
                      ("deep", "[" * 100_000), ("not-utf8", "\udcff\udcfe"),
                      ("null", "null")]:
        cases.append({"id": f"config-json-{name}", "kind": "cli", "ckpt": {"config_raw": raw},
                      "argv": _GEN, "expect": "config.json"})
    for name, raw in [("list", "[]"), ("garbage", "{{"), ("deep", "{\"a\":" * 50_000)]:
        cases.append({"id": f"generation-config-{name}", "kind": "cli",
                      "ckpt": {"gen_raw": raw}, "argv": _GEN,
                      "expect": "generation_config.json"})
    return cases


def _weight_cases() -> list[Case]:
    expect = {"truncate": ".safetensors", "empty": ".safetensors", "garbage": ".safetensors",
              "header-huge": ".safetensors", "dir": "x.safetensors", "loop": "loop.safetensors",
              "dangling": "gone.safetensors", "duplicate": "is in two files",
              "int-weights": "floating point", "bool-weights": "floating point",
              "missing": "missing", "extra": "unexpected", "shape": "shapes do not match",
              "pickle-only": "never unpickles", "none": "no *.safetensors",
              "model-is-file": "not a checkpoint directory",
              "model-missing": "not a checkpoint directory"}
    return [{"id": f"weights-{name}", "kind": "cli", "ckpt": {"weights": name}, "argv": _GEN,
             "expect": text} for name, text in expect.items()]


def _option_cases() -> list[Case]:
    bad = [("--block-size", "100000000"), ("--block-size", "0"), ("--block-size", "-4"),
           ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
           ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-k", "-1"),
           ("--seed", str(2**64)), ("--seed", "-1"), ("--tp", "0"), ("--tp", "100000"),
           ("--max-tokens", "-1"), ("--max-tokens", str(2**40)), ("--dist-timeout", "0"),
           ("--dist-timeout", "nan"), ("--prompt-ids", "1,x"), ("--prompt-ids", "-1"),
           ("--prompt-ids", ""), ("--prompt", "caf\udce9"), ("--dtype", "int8")]
    cases: list[Case] = [
        {"id": f"generate{opt}={value}", "kind": "cli", "argv": [*_GEN, opt, value],
         "expect": f"argument {opt}"} for opt, value in bad]
    cases += [
        {"id": "generate-prompt-ids-out-of-vocab", "kind": "cli",
         "argv": [*_GEN[:-1], "1,99999"], "expect": "token ids must be in [0, 64)"},
        {"id": "generate-too-long", "kind": "cli",
         "argv": [*_GEN[:4], "5000", *_GEN[5:]], "expect": "max_position_embeddings"},
        {"id": "generate-text-without-tokenizer", "kind": "cli",
         "argv": [*_GEN[:5], "--prompt", "hi"], "expect": "--prompt needs"},
        {"id": "generate-broken-tokenizer", "kind": "cli",
         "ckpt": {"tokenizer_raw": "{\"model\": 3}"}, "argv": [*_GEN[:5], "--prompt", "hi"],
         "expect": "tokenizer.json"},
        {"id": "generate-leftover-world-size", "kind": "cli", "argv": _GEN,
         "env": {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}, "expect": "WORLD_SIZE=2"},
        {"id": "generate-compile-mode-typo", "kind": "cli", "argv": _GEN,
         "env": {"OPMUX_COMPILE_MODE": "indcutor"}, "expect": "did you mean 'inductor'"},
        {"id": "explain-negative-shape", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape=-4,8", "--shape", "8"],
         "expect": "a shape is sizes >= 0"},
        {"id": "explain-huge-shape", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "100000,100000,100", "--shape", "100"],
         "expect": "a shape is sizes >= 0"},
        {"id": "explain-eps-negative", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--arg", "eps=-1",
                  "--json"], "expect": "rejects these arguments"},
        {"id": "explain-eps-text", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--arg",
                  "eps=abc"], "expect": "rejects these arguments"},
        {"id": "explain-int8", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--dtype", "int8"],
         "expect": "rejects these arguments"},
        {"id": "explain-device-nope", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--device",
                  "nope"], "expect": "--device 'nope'"},
        {"id": "explain-unknown-op", "kind": "cli", "argv": ["explain", "no_such_op"],
         "expect": "no_such_op"},
        {"id": "explain-arg-without-value", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--arg", "eps"],
         "expect": "expected name=value"},
        {"id": "tune-repeat-0", "kind": "cli", "argv": ["tune", "--repeat", "0", "--dry-run"],
         "expect": "argument --repeat"},
        {"id": "tune-ops-empty", "kind": "cli", "argv": ["tune", "--ops", "", "--dry-run"],
         "expect": "names no op"},
        {"id": "tune-shape-negative", "kind": "cli",
         "argv": ["tune", "--ops", "rms_norm", "--shape", "rms_norm=-4x8,8", "--dry-run"],
         "expect": "a shape is sizes >= 0"},
        {"id": "tune-shape-no-op", "kind": "cli",
         "argv": ["tune", "--ops", "rms_norm", "--shape", "4x8", "--dry-run"],
         "expect": "expected OP=AxB,C"},
    ]
    demo = ["demo", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
            "--vocab", "64", "--steps", "2", "--batch", "1"]
    cases += [
        {"id": "demo-device-nope", "kind": "cli", "argv": [*demo, "--device", "nope"],
         "expect": "--device 'nope'"},
        {"id": "demo-model-dir-not-empty", "kind": "cli",
         "argv": [*demo, "--model-dir", "{full}"], "expect": "is not empty"},
        {"id": "demo-model-dir-file", "kind": "cli",
         "argv": [*demo, "--model-dir", "{file}"], "expect": "is not a directory"},
        {"id": "demo-sizes-huge", "kind": "cli",
         "argv": ["demo", "--hidden", "65536", "--heads", "1024", "--vocab", "16000000",
                  "--model-dir", "{scratch}/m"], "expect": "random checkpoint of"},
        {"id": "demo-layers-0", "kind": "cli", "argv": [*demo, "--layers", "0"],
         "expect": "argument --layers"},
        {"id": "demo-seed-huge", "kind": "cli", "argv": [*demo, "--seed", str(2**70)],
         "expect": "argument --seed"},
        {"id": "demo-heads-odd", "kind": "cli", "argv": [*demo, "--hidden", "30"],
         "expect": "multiple of --heads"},
    ]
    return cases


def _cache_cases() -> list[Case]:
    deep = "[" * 200_000 + "]" * 200_000
    tuned: list[tuple[str, Any]] = [
        ("fingerprint-str", {"fingerprint": "x"}), ("fingerprint-list", {"fingerprint": [1]}),
        ("fingerprint-null", {"fingerprint": None}), ("format-2", {"format": 2}),
        ("format-str", {"format": "1"}), ("ops-list", {"ops": []}),
        ("ops-null", {"ops": None}), ("entry-list", {"ops": {"@OP": []}}),
        ("order-empty", {"ops": {"@OP": {"order": []}}}),
        ("order-str", {"ops": {"@OP": {"order": "native"}}}),
        ("order-ints", {"ops": {"@OP": {"order": [1, 2]}}}),
        ("order-unknown", {"ops": {"@OP": {"order": ["nobody"]}}}),
        ("unknown-op", {"ops": {"x::y": {"order": ["native"]}}}),
        ("bucket-superscript", {"ops": {"@OP": {"order": ["native"],
                                                "buckets": {"\u00b2": {"order": ["native"]}}}}}),
        ("bucket-negative", {"ops": {"@OP": {"order": ["native"],
                                             "buckets": {"-1": {"order": ["native"]}}}}}),
        ("bucket-huge", {"ops": {"@OP": {"order": ["native"],
                                         "buckets": {"999": {"order": ["native"]}}}}}),
        ("bucket-list", {"ops": {"@OP": {"order": ["native"], "buckets": [1]}}}),
        ("bucket-order-null", {"ops": {"@OP": {"order": ["native"],
                                               "buckets": {"3": {"order": None}}}}})]
    raw = [("deep", deep), ("huge", " " * (5 << 20)), ("not-json", "{"), ("empty", ""),
           ("list", "[]"), ("not-utf8", "\udcff\udcfe")]
    cases: list[Case] = [{"id": f"tuned-{n}", "kind": "tuned", "patch": p,
                          "expect": "ignoring the tuned table"} for n, p in tuned]
    cases += [{"id": f"tuned-raw-{n}", "kind": "tuned", "content": c,
               "expect": "ignoring the tuned table"} for n, c in raw]
    trace = [("negative", "{\"a\": {\"p\": -3}}"), ("bool", "{\"a\": {\"p\": true}}"),
             ("float", "{\"a\": {\"p\": 1.5}}"), ("string", "{\"a\": {\"p\": \"3\"}}"),
             ("null", "{\"a\": {\"p\": null}}"), ("per-op-list", "{\"a\": [1]}"),
             ("per-op-int", "{\"a\": 3}"), ("list-of-ints", "[1, 2]"), ("number", "7"),
             ("nested-counts", "{\"a\": {\"p\": {\"q\": 1}}}"), *raw]
    cases += [{"id": f"trace-{n}", "kind": "trace", "content": c,
               "expect": "ignoring the OPMUX_TRACE file"} for n, c in trace]
    stamp = [("list-of-one", "[1]"), ("size-str", "{\"library\": \"libfake.so\", \"size\": \"1\", "
                                           "\"sha256\": \"x\"}"),
             ("library-int", "{\"library\": 3, \"size\": 1, \"sha256\": \"x\"}"),
             ("files-escape", "{\"library\": \"libfake.so\", \"size\": 1, \"sha256\": \"x\", "
                              "\"files\": {\"../x\": \"y\"}}"),
             ("files-list", "{\"library\": \"libfake.so\", \"size\": 1, \"sha256\": \"x\", "
                            "\"files\": [1]}"), *raw]
    cases += [{"id": f"stamp-{n}", "kind": "stamp", "content": c,
               "expect": "ignoring the build stamp"} for n, c in stamp]
    return cases


CHECKPOINT_AND_CLI_CASES: list[Case] = _config_cases() + _weight_cases() + _option_cases()
CACHE_AND_TRACE_CASES: list[Case] = _cache_cases()
