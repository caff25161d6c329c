#!/usr/bin/python3
"""Turns the JSON lines scripts/bench collects into the markdown table of docs/PERFORMANCE.md.

Each line is {"engine": "moeline", "run": <moeline_bench object>} or
{"engine": "llama.cpp", "run": <llama-bench -o json array>}; rows are keyed by thread count so the
two engines land side by side with their ratio (and by decode depth, llama-bench's -d, when runs
start decoding after a context).
"""
import json
import sys


def main(path):
    ours, theirs = {}, {}
    with open(path) as lines:
        for line in lines:
            record = json.loads(line)
            if record["engine"] == "moeline":
                run = record["run"]
                ours[(run["threads"], run.get("decode_depth", 0))] = run
            else:
                for test in record["run"]:
                    entry = theirs.setdefault((test["n_threads"], test.get("n_depth", 0)), {})
                    key = "prefill" if test["n_prompt"] > 0 and test["n_gen"] == 0 else "decode"
                    entry[key] = test["avg_ts"]
    print("| threads | depth | prefill t/s | decode t/s | read GB/s | decode roofline t/s "
          "| decode / roofline | peak RSS GB | mapped weights GB | KV B/token (naive) "
          "| llama.cpp prefill t/s | llama.cpp decode t/s | prefill ratio | decode ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(ours):
        threads, depth = key
        run = ours[key]
        peer = theirs.get(key, {})
        def ratio(mine, other):
            return f"{mine / other:.2f}×" if other else "–"
        def value(number):
            return f"{number:.1f}" if number else "–"
        kv = f"{run.get('kv_bytes_per_token', 0):,} ({run.get('kv_naive_bytes_per_token', 0):,})"
        print(f"| {threads} | {depth} | {run['prefill_tokens_per_second']:.1f} "
              f"| {run['decode_tokens_per_second']:.1f} "
              f"| {run['read_bandwidth_gb_per_second']:.1f} | {run['decode_roofline_tokens_per_second']:.1f} "
              f"| {run['decode_fraction_of_roofline'] * 100:.0f}% | {run['peak_rss_bytes'] / 1e9:.2f} "
              f"| {run['mapped_weight_bytes'] / 1e9:.2f} | {kv} "
              f"| {value(peer.get('prefill'))} | {value(peer.get('decode'))} "
              f"| {ratio(run['prefill_tokens_per_second'], peer.get('prefill'))} "
              f"| {ratio(run['decode_tokens_per_second'], peer.get('decode'))} |")
    first = next(iter(ours.values()))
    print(f"\nModel {first['model']} ({first['weights']}), prompt {first['prompt_tokens']} tokens, "
          f"decode {first['decode_tokens']} tokens, kernels {first['isa']}, "
          f"{first['weight_bytes_per_decoded_token'] / 1e6:.1f} MB of weights per decoded token "
          f"(the roofline adds the KV cache each token reads: "
          f"{first.get('kv_bytes_read_per_decoded_token', 0) / 1e6:.1f} MB at depth {first.get('decode_depth', 0)}).")


if __name__ == "__main__":
    main(sys.argv[1])
