#!/usr/bin/env python3
"""Expert offload end to end, with real processes: `moeline stack up --expert-budget` with 2
prefill and 2 decode processes sharing the offload manager's host pool (POSIX shared memory),
against `moeline run` (every expert resident) as the reference.

Cases (--case, one per CTest entry):
  budgets   a malformed budget is refused with its reason; 100%, 50%, 25% of expert bytes and
            one expert per MoE layer: concurrent greedy and
            seeded requests give ids identical to the reference; the pool really loaded and
            evicted (the offload manager's /metrics), `moeline stack status` shows it, and
            `moeline experts` draws the router health (terminal and PNG)
  memory    one copy of the expert weights per node: the pool's pages are shared by every compute
            process (the sum of their PSS of the pool is one pool, not four), and no compute
            process has the checkpoint's expert bytes resident in its own mapping
  trace     the decode processes record their expert acquisitions (--expert-trace, one file per
            replica) and `moeline experts replay` replays them: no policy beats Belady's bound
  deepseek  a DeepSeek model (multi-head latent attention with its compressed cache, shared
            experts, group-limited routing) through the stack: exact reuse (prefix, full and
            result hits, the latent KV moved between processes) and 2 prefill + 2 decode sharing a
            25% pool, ids identical to `moeline run` throughout
  device    the compute stages on a GPU (`stack up --device cuda`). Without one (or in a build
            without nvcc) `stack up` stops with the reason, and malformed device flags are
            refused. With one: 2 prefill + 2 decode on the GPU give greedy ids identical to
            `moeline run` on the CPU with every expert on the device, and with half of them
            there fed from a half-size host pool; exact prefix reuse moves KV in and out of the
            device cache; the routers' usage still reaches the offload manager
  quantized the model as a GGUF of llama.cpp's Q4_K_M mix (scripts/gguf_convert.py) through
            2 prefill + 2 decode sharing a pool of 100%, 50% and 25% of its expert bytes, which
            the pool holds, reads and budgets as stored (4.5-6.5 bits a weight): concurrent greedy
            and seeded requests identical to `moeline run` on the same file; the pool's slots
            are the quantized experts' size
  restart   kill -9 of the offload manager: the compute processes notice its pool is gone, are
            restarted onto the new pool, and requests keep completing identically; kill -9 of a
            decode process mid-stream: its pins are taken back and requests complete
"""

import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stack_harness import (Skipped, Stack, gpu_expected, recovery_errors, reference,  # noqa: E402
                           run_cases, run_concurrently, sample_value)

COMPUTE = ["prefill-0", "prefill-1", "decode-0", "decode-1"]


def host_counter(metrics, what):
    """The host pool's moeline_offload_expert_<what>_total in an offload manager's metrics."""
    return sample_value(metrics, f"moeline_offload_expert_{what}_total", "offload", tier="host")


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def model_shape(model):
    """(vocab, MoE layers, bytes of one pool slot, all expert bytes) from config.json and the
    safetensors header (the pool's slot: gate, up, down 64-byte aligned, in whole pages)."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    experts = {}
    for name, info in header.items():
        if name == "__metadata__" or ".experts." not in name:
            continue
        owner = name.split(".experts.")[0] + "." + name.split(".experts.")[1].split(".")[0]
        start, end = info["data_offsets"]
        experts.setdefault(owner, []).append(end - start)
    layers = {owner.rsplit(".", 1)[0] for owner in experts}

    def slot(sizes):
        offset = 0
        for size in sizes[:-1]:
            offset = (offset + size + 63) // 64 * 64
        return (offset + sizes[-1] + 4095) // 4096 * 4096

    slot_bytes = max(slot(sizes) for sizes in experts.values())
    total = sum(sum(sizes) for sizes in experts.values())
    return config["vocab_size"], len(layers), slot_bytes, total


def workload(vocab, count, seed):
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        tokens = [rng.randrange(vocab) for _ in range(rng.choice([3, 17, 40, 90]))]
        request = {"tokens": tokens, "max_tokens": rng.randint(4, 24), "ignore_eos": True}
        if i % 4 == 1:
            request.update(temperature=0.8, seed=500 + i)
        requests.append(request)
    return requests


def references(args, requests):
    return [reference(args.moeline, args.model, r["max_tokens"], tokens=r["tokens"],
                      temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                      ignore_eos=True) for r in requests]


def compare(results, expected, label):
    for i, want in enumerate(expected):
        got = results[i]
        check(got["error"] is None, f"{label}: request {i} failed: {got['error']}")
        check(got["ids"] == want["ids"],
              f"{label}: request {i}: stack ids {got['ids']} != run ids {want['ids']}")


def pool_status(args, stack):
    out = subprocess.run([args.moeline, "stack", "status", "--run-dir", stack.run_dir, "--json"],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout).get("expert_pool")


def case_quantized(args):
    from moeline_client import Client
    vocab, moe_layers, _, _ = model_shape(args.model)
    gguf = os.path.join(args.workdir, "model.q4_k_m.gguf")
    convert = os.path.join(HERE, "..", "..", "scripts", "gguf_convert.py")
    subprocess.run([sys.executable, convert, "--model", args.model, "--out", gguf, "--type",
                    "q4_k_m"], check=True, capture_output=True, timeout=300)
    requests = workload(vocab, 16, seed=9)
    expected = [reference(args.moeline, gguf, r["max_tokens"], tokens=r["tokens"],
                          temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                          ignore_eos=True) for r in requests]
    slots = {}
    for budget in ("100%", "50%", "25%"):
        run_dir = os.path.join(args.workdir, "quantized-" + budget.rstrip("%"))
        with Stack(args.moeline, gguf, run_dir, prefill=2, decode=2,
                   expert_budget=budget) as stack:
            with Client(stack.endpoint, timeout=120) as client:
                results = run_concurrently(client, requests)
            compare(results, expected, f"Q4_K_M at {budget}")
            metrics = stack.metrics_once("offload", lambda m: host_counter(m, "loads") > 0 and (
                budget == "100%" or host_counter(m, "evictions") > 0))
            loads, evictions = (host_counter(metrics, what) for what in ("loads", "evictions"))
            check(loads > 0, f"Q4_K_M at {budget}: the pool loaded nothing")
            if budget != "100%":
                check(evictions > 0, f"Q4_K_M at {budget}: no eviction under all experts")
            slots[budget] = pool_status(args, stack)["slots"]
            print(f"ok quantized: Q4_K_M at {budget} ({slots[budget]} slots): 16 concurrent "
                  f"requests identical to moeline run; loads {loads:.0f}, evictions "
                  f"{evictions:.0f}")
    # The budget counts stored bytes: 25% of the quantized experts' bytes holds about a quarter
    # of the experts (it would hold under a tenth if slots were sized for BF16 experts).
    with open(os.path.join(args.model, "config.json")) as f:
        experts = moe_layers * json.load(f)["num_experts"]
    check(slots["100%"] >= experts, f"the 100% pool has {slots['100%']} slots for {experts} experts")
    check(slots["25%"] >= experts // 5,
          f"the 25% pool has {slots['25%']} slots for {experts} quantized experts")
    print(f"ok quantized: {experts} experts; pool slots {slots}")


def case_budgets(args):
    from moeline_client import Client
    vocab, moe_layers, slot_bytes, total = model_shape(args.model)
    requests = workload(vocab, 24, seed=3)
    expected = references(args, requests)
    # A budget that is not one: `stack up` fails with the offload manager's reason.
    bad_dir = os.path.join(args.workdir, "bad-budget")
    out = subprocess.run([args.moeline, "stack", "up", "--model", args.model, "--run-dir", bad_dir,
                          "--expert-budget", "12parsecs", "--timeout-s", "60", "--http-port", "off"],
                         capture_output=True, text=True, timeout=120)
    subprocess.run([args.moeline, "stack", "down", "--run-dir", bad_dir], capture_output=True,
                   timeout=60)
    check(out.returncode != 0 and "expert budget '12parsecs'" in out.stderr,
          f"stack up with a bad budget: {out.returncode} {out.stderr[-500:]}")
    print("ok budgets: a malformed --expert-budget stops `stack up` with the reason")
    budgets = [("100%", "100%"), ("50%", "50%"), ("25%", "25%"),
               ("one expert per layer", str(moe_layers * slot_bytes))]
    for label, budget in budgets:
        run_dir = os.path.join(args.workdir, "budget-" + label.split()[0].rstrip("%"))
        with Stack(args.moeline, args.model, run_dir, prefill=2, decode=2,
                   expert_budget=budget) as stack:
            with Client(stack.endpoint, timeout=120) as client:
                results = run_concurrently(client, requests)
            compare(results, expected, label)
            # The manager publishes the pool's counters every 0.5 s, and bytes per token once
            # the processes' expert usage (about once a second) has counted the tokens.
            def published(m):
                loads = host_counter(m, "loads")
                return loads > 0 and (label == "100%" or host_counter(m, "evictions") > 0) and \
                    loads == sample_value(m, "moeline_offload_expert_load_seconds_count",
                                          "offload", tier="host") and \
                    sample_value(m, "moeline_offload_bytes_per_token", "offload", tier="host") > 0
            metrics = stack.metrics_once("offload", published)
            hits, misses, loads, evictions = (host_counter(metrics, what)
                                              for what in ("hits", "misses", "loads", "evictions"))
            check(hits + misses > 0 and loads > 0, f"{label}: the pool served nothing "
                  f"(hits {hits}, misses {misses}, loads {loads})")
            if label != "100%":
                check(evictions > 0, f"{label}: no eviction at a budget under all experts")
            status = pool_status(args, stack)
            check(status and status["slots"] > 0, f"{label}: stack status shows no pool: {status}")
            load_count = sample_value(metrics, "moeline_offload_expert_load_seconds_count",
                                      "offload", tier="host")
            check(load_count == loads, f"{label}: the load-time histogram counts {load_count} "
                  f"loads, the counter {loads}")
            check(sample_value(metrics, "moeline_offload_bytes_per_token", "offload",
                               tier="host") > 0,
                  f"{label}: no bytes per token")
            if label == "25%":
                check_experts_command(args, stack, moe_layers)
            served = [stack.metric(name, "moeline_prefill_tokens_total")
                      if name.startswith("prefill") else
                      stack.metric(name, "moeline_decode_tokens_total") for name in COMPUTE]
            print(f"ok budgets: {label} ({status['slots']} slots): 24 concurrent requests "
                  f"identical to moeline run; hits {hits:.0f}, misses {misses:.0f}, loads "
                  f"{loads:.0f}, evictions {evictions:.0f}; per process {served}")


def check_experts_command(args, stack, moe_layers):
    """`moeline experts`: the heat map has a row per MoE layer, the PNG is one, the JSON report
    adds up to the routed tokens."""
    import struct
    png = os.path.join(stack.run_dir, "heat.png")
    out = subprocess.run([args.moeline, "experts", "--run-dir", stack.run_dir, "--png", png],
                         capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, f"moeline experts failed: {out.stderr}")
    rows = [line for line in out.stdout.splitlines() if line[:1].isdigit()]
    check(len(rows) == moe_layers, f"moeline experts: {len(rows)} layer rows, want {moe_layers}:\n"
          f"{out.stdout}")
    with open(png, "rb") as f:
        data = f.read()
    check(data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    report = json.loads(subprocess.run([args.moeline, "experts", "--run-dir", stack.run_dir,
                                        "--json"], capture_output=True, text=True,
                                       timeout=30).stdout)
    experts = len(report["router"][0]["counts"])
    # A labelled picture: the grid of 24-pixel cells (a row per MoE layer, a column per expert)
    # inside a title, axis labels and a colour scale.
    check(experts * 24 < width and moe_layers * 24 < height < moe_layers * 24 + 200,
          f"PNG is {width}x{height} for {experts} experts and {moe_layers} layers")
    routed = [sum(layer["counts"]) for layer in report["router"] if layer["tokens"]]
    check(len(routed) == moe_layers and all(n > 0 for n in routed), f"router counts: {routed}")
    bad = subprocess.run([args.moeline, "experts", "--run-dir", "/nonexistent"],
                         capture_output=True, text=True, timeout=30)
    check(bad.returncode == 1 and "no offload manager" in bad.stderr,
          f"experts on a missing stack: {bad.returncode} {bad.stderr}")
    print(f"ok budgets: moeline experts drew {moe_layers} layers ({width}x{height} PNG)")


def mapping_kib(pid, predicate):
    """(Rss, Pss) in KiB of the mappings of `pid` whose path satisfies `predicate`."""
    rss = pss = 0
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                current = fields[5] if len(fields) >= 6 else ""
            elif fields[0] == "Rss:" and current and predicate(current):
                rss += int(fields[1])
            elif fields[0] == "Pss:" and current and predicate(current):
                pss += int(fields[1])
    return rss, pss


def case_memory(args):
    from moeline_client import Client
    vocab, _, slot_bytes, total = model_shape(args.model)
    requests = workload(vocab, 16, seed=5)
    checkpoint = os.path.realpath(os.path.join(args.model, "model.safetensors"))
    checkpoint_bytes = os.path.getsize(checkpoint)
    run_dir = os.path.join(args.workdir, "memory")
    with Stack(args.moeline, args.model, run_dir, prefill=2, decode=2,
               expert_budget="100%") as stack:
        with Client(stack.endpoint, timeout=120) as client:
            run_concurrently(client, requests)
        pool_name = pool_status(args, stack)["name"]
        in_pool = lambda path: path == "/dev/shm" + pool_name  # noqa: E731
        pool_rss, pool_pss, expert_rss = [], [], []
        for name in COMPUTE:
            pid = stack.stage(name)["pid"]
            rss, pss = mapping_kib(pid, in_pool)
            pool_rss.append(rss)
            pool_pss.append(pss)
            expert_rss.append(mapping_kib(pid, lambda path: path == checkpoint)[0])
        pool_kib = (total + 1023) // 1024
        # Every compute process touched the experts it used, through the pool; their PSS of it
        # adds up to (at most) one pool, however many processes map it.
        check(max(pool_rss) > 0, f"no compute process maps the pool: {pool_rss}")
        check(sum(pool_pss) <= pool_kib * 1.1 + 64,
              f"the pool's PSS over 4 processes is {sum(pool_pss)} KiB, more than one pool "
              f"({pool_kib} KiB of experts): {pool_pss}")
        # The checkpoint mapping holds the attention weights, embeddings and LM head; the expert
        # bytes are read into the pool with O_DIRECT, never faulted in here. Fault-around may map a
        # few neighbouring pages, hence the slack of 10% of the expert bytes.
        non_expert_kib = (checkpoint_bytes - total) // 1024
        limit = non_expert_kib + total // 1024 // 10
        check(max(expert_rss) <= limit,
              f"a compute process has {max(expert_rss)} KiB of the checkpoint resident, more than "
              f"its {non_expert_kib} KiB of non-expert weights (+10% of the experts): {expert_rss}")
        print(f"ok memory: pool {pool_kib} KiB; PSS of the pool per process {pool_pss} KiB "
              f"(sum {sum(pool_pss)}); Rss of the checkpoint per process {expert_rss} KiB "
              f"(non-expert weights: {non_expert_kib} KiB)")


def case_trace(args):
    """Routing recorded by the stack's prefill and decode processes and replayed offline: each
    process's file names it and its kind, their merge is replayed as the one stream the shared pool
    saw, the hit ratios are ordered (Belady's bound is the best) and given per process kind."""
    from moeline_client import Client
    vocab, _, _, _ = model_shape(args.model)
    run_dir = os.path.join(args.workdir, "trace")
    pattern = os.path.join(args.workdir, "trace-{replica}.txt")
    names = ("prefill-0", "decode-0", "decode-1")
    for name in names:
        path = pattern.replace("{replica}", name)
        if os.path.exists(path):
            os.remove(path)
    config = {"decode": {"expert-trace": pattern}, "prefill": {"expert-trace": pattern}}
    with Stack(args.moeline, args.model, run_dir, decode=2, config=config,
               expert_budget="50%") as stack:
        with Client(stack.endpoint, timeout=120) as client:
            run_concurrently(client, workload(vocab, 12, seed=4))
    traces = [pattern.replace("{replica}", name) for name in names]
    written = [path for path in traces if os.path.exists(path)]
    check(len(written) == len(traces), f"not every process wrote its trace: {written}")
    for path in written:
        with open(path) as f:
            header = f.readline()
        name = os.path.basename(path)[len("trace-"):-len(".txt")]
        check(f"process={name} kind={name.split('-')[0]}" in header,
              f"{path}: the header does not name its process: {header}")
    for kinds, paths in (("one decode process", written[1:2]), ("all three", written)):
        out = subprocess.run([args.moeline, "experts", "replay", "--trace", ",".join(paths),
                              "--budgets", "100%,50%,25%", "--json"], capture_output=True,
                             text=True, timeout=120)
        check(out.returncode == 0, f"replay failed: {out.stderr}")
        report = json.loads(out.stdout)
        check(report["accesses"] > 0, f"{kinds}: an empty trace")
        check(len(report["processes"]) == len(paths), f"{kinds}: {report['processes']}")
        for row in report["budgets"]:
            for policy in ("lru", "lru2", "lfu", "distance", "distance-stream", "distance-all",
                           "distance-area", "step-oracle"):
                check(row[policy] <= row["belady"] + 1e-12,
                      f"{kinds} {row['budget']}: {policy} {row[policy]} beats Belady {row['belady']}")
            if len(paths) == 3:
                by_kind = row["by_kind"]
                check(set(by_kind) == {"prefill", "decode"}, f"kinds: {sorted(by_kind)}")
                check(all(by_kind[k]["accesses"] > 0 for k in by_kind), f"{by_kind}")
                # The whole stream's ratio is the per-kind ratios weighted by their accesses.
                total = sum(by_kind[k]["accesses"] for k in by_kind)
                weighted = sum(by_kind[k]["belady"] * by_kind[k]["accesses"] for k in by_kind) / total
                check(abs(weighted - row["belady"]) < 1e-9, f"{weighted} vs {row['belady']}")
        ratios = [row["belady"] for row in report["budgets"]]
        check(ratios == sorted(ratios, reverse=True), f"{kinds}: Belady not monotone in budget")
        print(f"ok trace ({kinds}): {report['accesses']} acquisitions; Belady at "
              f"100/50/25%: {', '.join(f'{r:.3f}' for r in ratios)}")


def case_deepseek(args):
    from moeline_client import Client
    with open(os.path.join(args.model, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    check(model_type.startswith("deepseek"), f"--model is a {model_type}, not a DeepSeek model")
    vocab, moe_layers, slot_bytes, total = model_shape(args.model)
    rng = random.Random(21)
    system = [rng.randrange(vocab) for _ in range(32)]  # two full KV blocks shared by the prompts

    def prompt(extra):
        return system + [rng.randrange(vocab) for _ in range(extra)]

    # Exact reuse: the probe stores and serves latent KV (keys only on the wire).
    run_dir = os.path.join(args.workdir, "deepseek-reuse")
    with Stack(args.moeline, args.model, run_dir, decode=2) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            first = {"tokens": prompt(9), "max_tokens": 10, "ignore_eos": True}
            cases = [("first", first, "none", 0),
                     ("exact greedy repeat", first, "result", len(first["tokens"])),
                     ("same prompt, other max_tokens", dict(first, max_tokens=6), "full",
                      len(first["tokens"])),
                     ("shared prefix, new suffix",
                      {"tokens": prompt(13), "max_tokens": 10, "ignore_eos": True}, "prefix", 32)]
            for label, request, level, reused in cases:
                result = client.generate(**request)
                want = reference(args.moeline, args.model, request["max_tokens"],
                                 tokens=request["tokens"], ignore_eos=True)
                check(result.ids == want["ids"],
                      f"{label}: stack ids {result.ids} != run ids {want['ids']}")
                usage = result.usage
                check(usage["reuse_level"] == level and usage["reused_tokens"] == reused,
                      f"{label}: {usage}, want {level} with {reused} tokens")
                print(f"ok deepseek: {label} -> {level}, {reused} tokens reused, identical to run")
            wave = [{"tokens": prompt(5 + i), "max_tokens": 8, "ignore_eos": True}
                    for i in range(6)]
            compare(run_concurrently(client, wave), references(args, wave), "prefix wave")
            print("ok deepseek: 6 concurrent prefix hits on 2 decode replicas, identical to run")

    # Offload: 2 prefill + 2 decode on a quarter of the routed experts' bytes (the shared experts
    # are layer weights, always resident).
    requests = workload(vocab, 16, seed=11)
    expected = references(args, requests)
    run_dir = os.path.join(args.workdir, "deepseek-offload")
    with Stack(args.moeline, args.model, run_dir, prefill=2, decode=2,
               expert_budget="25%") as stack:
        with Client(stack.endpoint, timeout=120) as client:
            compare(run_concurrently(client, requests), expected, "25%")
        # The manager publishes the pool's counters every 0.5 s.
        metrics = stack.metrics_once("offload", lambda m: host_counter(m, "evictions") > 0)
        evictions = host_counter(metrics, "evictions")
        check(evictions > 0, f"25%: no eviction (evictions {evictions})")
        status = pool_status(args, stack)
        check(status and 0 < status["slots"] * slot_bytes <= total // 4 + slot_bytes,
              f"25%: the pool is not a quarter of the experts: {status}")
        print(f"ok deepseek: 2 prefill + 2 decode on a 25% pool ({status['slots']} slots of "
              f"{moe_layers} MoE layers' experts): 16 concurrent requests identical to moeline "
              f"run, {evictions:.0f} evictions")


def gpu_missing(args):
    """Why `--device cuda` cannot run here, or None when it can."""
    out = subprocess.run([args.moeline, "run", "--model", args.model, "--device", "cuda",
                          "--tokens", "1,2,3", "--max-tokens", "1", "--json"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode == 0:
        return None
    check("--device cuda:" in out.stderr, f"moeline run --device cuda failed: {out.stderr}")
    return out.stderr.strip().splitlines()[-1]


def case_device(args):
    from moeline_client import Client
    vocab, moe_layers, slot_bytes, total = model_shape(args.model)

    def stack_up_fails(label, flags, reason):
        run_dir = os.path.join(args.workdir, "device-refused")
        out = subprocess.run([args.moeline, "stack", "up", "--model", args.model, "--run-dir",
                              run_dir, "--timeout-s", "60", "--http-port", "off"] + flags,
                             capture_output=True, text=True, timeout=180)
        subprocess.run([args.moeline, "stack", "down", "--run-dir", run_dir],
                       capture_output=True, timeout=60)
        check(out.returncode != 0 and reason in out.stderr,
              f"{label}: stack up {flags}: {out.returncode} {out.stderr[-800:]}")
        print(f"ok device: {label}: `stack up` refused with the reason")

    stack_up_fails("a device that is not one", ["--device", "tpu"],
                   "--device must be cpu, cuda or cuda:N")
    stack_up_fails("a device budget without a device", ["--device-expert-budget", "50%"],
                   "--device-expert-budget needs --device cuda")
    missing = gpu_missing(args)
    if missing is not None:
        # The compute stages say why and exit; `stack up` shows their log rather than hanging.
        stack_up_fails("no usable GPU", ["--device", "cuda"], "--device cuda:")
        expected = gpu_expected()
        check(expected is None, f"device: a GPU is expected here ({expected}) but --device cuda "
              f"cannot use it: {missing}")
        raise Skipped(f"the GPU half of this case needs a GPU ({missing})")

    rng = random.Random(31)
    system = [rng.randrange(vocab) for _ in range(32)]
    requests = [{"tokens": system + [rng.randrange(vocab) for _ in range(rng.choice([3, 20, 45]))],
                 "max_tokens": rng.randint(6, 20), "ignore_eos": True} for _ in range(12)]
    expected = references(args, requests)
    for label, budget in [("every expert on the device", []),
                          ("half the experts on the device, a half-size host pool",
                           ["--device-expert-budget", "50%"])]:
        run_dir = os.path.join(args.workdir, "device")
        host = "50%" if budget else None
        with Stack(args.moeline, args.model, run_dir, prefill=2, decode=2, expert_budget=host,
                   extra_args=["--device", "cuda"] + budget) as stack:
            with Client(stack.endpoint, timeout=120) as client:
                first = client.generate(**requests[0])
                check(first.ids == expected[0]["ids"],
                      f"{label}: {first.ids} != run ids {expected[0]['ids']}")
                # The shared 32-token prefix is now in the store: the rest are prefix hits whose
                # KV is imported into the device caches.
                results = run_concurrently(client, requests[1:])
                compare(results, expected[1:], label)
                hits = sum(1 for r in results.values()
                           if r["usage"] and r["usage"].get("reuse_level") == "prefix")
                check(hits > 0, f"{label}: no prefix hit on the GPU stack")
            time.sleep(1.5)  # usage reports go out every second
            routed = stack.metric("offload", "moeline_offload_routed_tokens_total")
            check(routed and routed > 0, f"{label}: no expert usage reached the offload manager")
        print(f"ok device: {label}: 2 prefill + 2 decode on the GPU, {len(requests)} requests "
              f"identical to moeline run on the CPU, {hits} prefix hits, {routed:.0f} routed tokens "
              f"reported")


def case_restart(args):
    from moeline_client import Client
    vocab, _, _, _ = model_shape(args.model)
    requests = workload(vocab, 8, seed=9)
    expected = references(args, requests)
    run_dir = os.path.join(args.workdir, "restart")
    with Stack(args.moeline, args.model, run_dir, prefill=1, decode=1,
               expert_budget="25%") as stack:
        with Client(stack.endpoint, timeout=120) as client:
            compare(run_concurrently(client, requests), expected, "before")
            old = {name: stack.stage(name)["pid"] for name in ("prefill-0", "decode-0")}
            stack.wait_restarted("offload", stack.kill("offload"))
            for name, pid in old.items():
                stack.wait_restarted(name, pid, timeout=30)
            stack.wait_healthy(60, "the stack did not become healthy after the offload restart")
            # Computed again (not replayed from the store), on the new pool.
            computed = [dict(r, reuse="none") for r in requests]
            compare(run_concurrently(client, computed), expected, "after")
            print("ok restart: after kill -9 of the offload manager the compute processes moved "
                  "to the new pool and requests stayed identical")

            # kill -9 of a decode process mid-stream: the pins it held come back, the restarted
            # process serves again, and every request completes or fails explicitly.
            import threading
            long_requests = [dict(r, max_tokens=300, reuse="none") for r in requests]
            long_expected = references(args, long_requests)
            results = {}
            retried_before = stack.metric("gateway", "moeline_gateway_retries_total")
            worker = threading.Thread(
                target=lambda: results.update(run_concurrently(client, long_requests)))
            worker.start()
            deadline = time.time() + 60
            while time.time() < deadline and \
                    stack.metric("decode-0", "moeline_decode_active_sequences") < 1:
                time.sleep(0.01)
            old = stack.kill("decode-0")
            worker.join(timeout=180)
            check(not worker.is_alive(), "requests hung after kill -9 of a decode process")
            retried = stack.metric("gateway", "moeline_gateway_retries_total") - retried_before
            check(retried >= 1, "nothing was retried after decode-0 was killed mid-stream")
            given_up = recovery_errors(results, retried, "kill -9 of decode-0")
            for i, want in enumerate(long_expected):
                got = results[i]
                if got["error"] is None:
                    check(got["ids"] == want["ids"], f"request {i}: ids differ after the kill "
                          f"(retried or not, a completed request matches moeline run)")
            stack.wait_restarted("decode-0", old)
            deadline = time.time() + 20
            while time.time() < deadline:
                pool = pool_status(args, stack)
                if pool and pool.get("pinned") == 0 and pool.get("clients_reclaimed", 0) >= 1 \
                        and stack.healthy():
                    break
                time.sleep(0.3)
            check(pool and pool.get("pinned") == 0, f"pins still held after the kill: {pool}")
            check(pool.get("clients_reclaimed", 0) >= 1,
                  f"the killed process's client slot was not taken back: {pool}")
            compare(run_concurrently(client, computed), expected, "after the decode kill")
            print(f"ok restart: kill -9 of decode-0 mid-stream: {len(long_requests) - given_up} "
                  f"completed identically, {given_up} gave up after their retries ({retried:.0f} "
                  f"retried), no other error; no pin left behind "
                  f"({pool.get('clients_reclaimed')} dead client(s) reclaimed)")


def case_prefetch_switch(args):
    """Prefetch that does not pay turns itself off: with a threshold any late or wasted prefetch
    passes, the offload manager switches decode's prefetch off (metric, log line), outputs stay
    identical to `moeline run`, and after the retry time it is switched on again to be judged
    anew."""
    from moeline_client import Client
    vocab, _, _, _ = model_shape(args.model)
    requests = workload(vocab, 12, seed=13)
    expected = references(args, requests)
    run_dir = os.path.join(args.workdir, "prefetch-switch")
    config = {"offload": {"prefetch-depth": 1, "prefetch-bad-share": 0.001,
                          "prefetch-window": 20, "prefetch-retry-s": 2}}
    with Stack(args.moeline, args.model, run_dir, prefill=1, decode=2, config=config,
               expert_budget="25%") as stack:
        enabled = stack.metric("offload", "moeline_offload_prefetch_enabled", kind="decode")
        check(enabled == 1, f"prefetch is not on at start: {enabled}")
        with Client(stack.endpoint, timeout=120) as client:
            compare(run_concurrently(client, requests), expected, "prefetch judged")
        deadline = time.time() + 20
        switched = 0
        while time.time() < deadline and not switched:
            switched = stack.metric("offload", "moeline_offload_prefetch_switched_off_total",
                                    kind="decode")
            time.sleep(0.3)
        check(switched >= 1, "decode's prefetch was never switched off")
        log = open(os.path.join(run_dir, "logs", "offload.log")).read()
        check("event=prefetch_switched_off kind=decode" in log and "late_share=" in log,
              "no prefetch_switched_off line in the offload manager's log")
        deadline = time.time() + 20
        while time.time() < deadline and "event=prefetch_retried kind=decode" not in log:
            time.sleep(0.3)
            log = open(os.path.join(run_dir, "logs", "offload.log")).read()
        check("event=prefetch_retried kind=decode" in log, "prefetch was not tried again")
        print(f"ok prefetch switch: decode's prefetch switched off {switched:.0f} time(s) and "
              f"retried; outputs identical to moeline run")


if __name__ == "__main__":
    run_cases({"budgets": case_budgets, "memory": case_memory, "restart": case_restart,
               "trace": case_trace, "quantized": case_quantized,
               "prefetch_switch": case_prefetch_switch, "deepseek": case_deepseek, "device": case_device}, __doc__)
