#!/usr/bin/env python3
"""Approximate reuse end to end, with real processes (`moeline stack up`, the Python SDK,
`moeline client`, `moeline run` as the reference).

Cases (--case, one per CTest entry):
  approximate  requests opt in (and a tenant must allow it); response reuse serves the nearest
               cached prompt's answer; blended reuse with everything recomputed gives exactly the
               tokens of `moeline run` (the transplant, the mask and the import are right); the
               index is rebuilt from the disk tier after the probe restarts
  rollback     each trigger of the rollback controller with short windows — low hit rate, a drop
               of shadow agreement below its baseline, negative feedback on reused answers — turns
               approximate reuse off (status, /healthz, metrics, `moeline stack status`) within
               seconds; exact reuse keeps working; an operator turns it on again
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stack_harness import (Stack, reference, run_cases, run_concurrently,  # noqa: E402
                           vocab_of, wait_for)

# Every cached prompt of the tenant is a candidate (cosine > -0.99), and no error bound holds a
# candidate back (delta 1): the tests choose what is served by what they put in each tenant.
OPEN_RULE = {"approximate-threshold": -0.99, "approximate-max-error": 1,
             "approximate-shadow-fraction": 0}


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def status(moeline, endpoint):
    out = subprocess.run([moeline, "client", "status", "--endpoint", endpoint],
                         capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, out.stderr)
    return json.loads(out.stdout)


def approximate_state(moeline, endpoint):
    return status(moeline, endpoint)["approximate"]


def wait_until_off(moeline, endpoint, timeout):
    """Seconds until the controller reports off (polled); raises after `timeout`."""
    start = time.time()
    while time.time() - start < timeout:
        state = approximate_state(moeline, endpoint)
        if not state["enabled"]:
            return time.time() - start, state
        time.sleep(0.1)
    raise AssertionError(f"approximate reuse still on after {timeout} s: {state}")


def case_approximate(args):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    rng = random.Random(11)
    # 56 tokens: a blend needs a block of the donor's KV past the exact prefix (below: two blocks).
    donor = [rng.randrange(vocab) for _ in range(56)]
    near = list(donor)
    near[30] = (near[30] + 1) % vocab
    config = {"gateway": {"reuse-levels": "all"},
              "probe": {**OPEN_RULE, "approximate-recompute-fraction": 1.0}}
    run_dir = os.path.join(args.workdir, "approximate")
    with Stack(args.moeline, args.model, run_dir, config=config) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            # Without the opt-in nothing changes.
            plain = generate_donor(stack, client, tokens=donor, max_tokens=8, tenant="t1")
            check(plain.usage["approximate"] == "", f"not asked, yet {plain.usage}")
            want_donor = reference(args.moeline, args.model, 8, tokens=donor)
            check(plain.ids == want_donor["ids"], "the donor's answer differs from run")

            # Response reuse: the nearest cached prompt's answer, for a deterministic request.
            served = client.generate(tokens=near, max_tokens=8, tenant="t1", reuse="approximate")
            check(served.usage["approximate"] == "response" and
                  served.usage["reuse_level"] == "response",
                  f"a near-duplicate was not served by response reuse: {served.usage}")
            check(served.ids == want_donor["ids"], "response reuse did not replay the donor")
            check(served.usage["similarity"] > 0.9,
                  f"one changed token in 56, similarity {served.usage['similarity']}")
            print(f"ok approximate: response reuse replays the donor's answer "
                  f"(similarity {served.usage['similarity']:.4f})")

            # Another tenant never sees t1's prompts.
            other = client.generate(tokens=near, max_tokens=8, tenant="t2", reuse="approximate")
            check(other.usage["approximate"] == "no_candidate", f"tenant leak: {other.usage}")

            # A tenant that does not allow approximate reuse: asked, not given, and said so.
            subprocess.run([args.moeline, "client", "reuse", "--endpoint", stack.endpoint,
                            "--tenant", "closed", "--levels", "exact"], check=True,
                           capture_output=True)
            client.generate(tokens=donor, max_tokens=8, tenant="closed")
            closed = client.generate(tokens=near, max_tokens=8, tenant="closed",
                                     reuse="approximate")
            check(closed.usage["approximate"] == "not_allowed", f"{closed.usage}")
            check(closed.ids == reference(args.moeline, args.model, 8, tokens=near)["ids"],
                  "a request refused approximate reuse was not computed in full")
            print("ok approximate: other tenants see nothing; a tenant that does not allow it "
                  "gets exact reuse and usage says not_allowed")

            # Blended reuse with every token recomputed (recompute fraction 1): exactly the
            # tokens of a full prefill, though the KV started as the donor's, moved.
            shifted = [7, 8] + near  # two tokens in front: every donor token moves by 2
            blended = client.generate(tokens=shifted, max_tokens=8, tenant="t1", reuse="blend")
            check(blended.usage["approximate"] == "blend" and
                  blended.usage["reuse_level"] == "blend", f"not blended: {blended.usage}")
            want = reference(args.moeline, args.model, 8, tokens=shifted)
            check(blended.ids == want["ids"],
                  f"blend with full recomputation differs: {blended.ids} != {want['ids']}")
            # A blend that continues an exact prefix (the donor's first two blocks): the prefix
            # is imported as it is, never recomputed; the rest is blended (here: recomputed).
            late = list(donor)
            late[37] = (late[37] + 1) % vocab
            continued = client.generate(tokens=late, max_tokens=8, tenant="t1", reuse="blend")
            check(continued.usage["reuse_level"] == "blend" and
                  continued.usage["reused_tokens"] == 32,
                  f"a blend over a cached prefix: {continued.usage}")
            check(continued.ids == reference(args.moeline, args.model, 8, tokens=late)["ids"],
                  "a blend over an exact prefix differs from run")
            # Less than a block of the donor past the exact prefix (a change in its last, partial
            # block): no blend, the prefix hit and a plain prefill of the rest.
            tail = list(donor)
            tail[50] = (tail[50] + 1) % vocab
            unblended = client.generate(tokens=tail, max_tokens=8, tenant="t1", reuse="blend")
            check(unblended.usage["approximate"] == "no_candidate" and
                  unblended.usage["reuse_level"] == "prefix" and
                  unblended.usage["reused_tokens"] == 48,
                  f"a blend of 7 donor tokens past a 48-token prefix: {unblended.usage}")
            check(unblended.ids == reference(args.moeline, args.model, 8, tokens=tail)["ids"],
                  "a prefix hit past which nothing was blended differs from run")
            # Several at once over the same template: one prefill batch shares the prefix blocks.
            wave = []
            for i in range(4):
                prompt = list(donor)
                prompt[33 + i] = (prompt[33 + i] + 3) % vocab
                wave.append({"tokens": prompt, "max_tokens": 6, "tenant": "t1", "reuse": "blend"})
            results = run_concurrently(client, wave)
            for i, request in enumerate(wave):
                want = reference(args.moeline, args.model, 6, tokens=request["tokens"])
                check(results[i]["ids"] == want["ids"] and
                      results[i]["usage"]["reuse_level"] == "blend",
                      f"concurrent blend {i}: {results[i]['usage']}")
            check(stack.metric("prefill-0", "moeline_prefill_blend_jobs_total") >= 6,
                  "prefill counted no blend")
            print("ok approximate: blends recomputing everything equal `moeline run` exactly "
                  "(shifted, over an exact prefix, four at once over one template); none with "
                  "less than a block of the donor past the prefix")
            # A served blend is approximate: nothing of it enters the exact store, so the same
            # prompt asked with exact reuse alone is computed (no full or result hit).
            exact_again = client.generate(tokens=shifted, max_tokens=8, tenant="t1", reuse="exact")
            check(exact_again.usage["reuse_level"] == "none",
                  f"a blended prompt came back from the exact store: {exact_again.usage}")
            print("ok approximate: a served blend stores nothing the exact levels would serve")

            # Of several candidates, the one whose tokens differ least from the prompt's is
            # served: a query one token from donor A and four from B gets A's answer. (B is A with
            # three tokens changed, chosen so that their answers differ.)
            first = [rng.randrange(vocab) for _ in range(40)]
            for _ in range(20):
                second = list(first)
                for position in rng.sample(range(4, 36), 3):
                    second[position] = rng.randrange(vocab)
                if (reference(args.moeline, args.model, 8, tokens=second)["ids"] !=
                        reference(args.moeline, args.model, 8, tokens=first)["ids"]):
                    break
            else:
                raise AssertionError("no second donor with another answer in 20 tries")
            answer_first = generate_donor(stack, client, tokens=first, max_tokens=8, tenant="t4")
            generate_donor(stack, client, tokens=second, max_tokens=8, tenant="t4")
            query = list(first)
            query[38] = (query[38] + 1) % vocab
            nearest = client.generate(tokens=query, max_tokens=8, tenant="t4", reuse="response")
            check(nearest.usage["approximate"] == "response" and nearest.ids == answer_first.ids,
                  f"the nearer donor's answer was not served: {nearest.usage}")
            print("ok approximate: of two candidates, the one nearer the prompt is served")

            # The CLI says which level served the request.
            out = subprocess.run([args.moeline, "client", "generate", "--endpoint", stack.endpoint,
                                  "--tokens", ",".join(map(str, near)), "--max-tokens", "8",
                                  "--tenant", "t3", "--reuse", "approximate", "--json"],
                                 capture_output=True, text=True, timeout=60)
            check(out.returncode == 0, out.stderr)
            usage = json.loads(out.stdout)["usage"]
            check(usage["approximate"] == "no_candidate" and usage["reuse_level"] == "none",
                  f"client --json: {usage}")
            out = subprocess.run([args.moeline, "client", "generate", "--endpoint", stack.endpoint,
                                  "--tokens", "1,2", "--reuse", "sometimes"],
                                 capture_output=True, text=True, timeout=60)
            check(out.returncode == 2 and "--reuse" in out.stderr, out.stderr)
            # The SDK refuses an unknown mode before sending it.
            try:
                client.generate(tokens=near, reuse="sometimes")
                check(False, "an unknown reuse mode was sent")
            except ValueError:
                pass

        # A graceful restart of the probe: the index comes back from the disk tier. (The last
        # request's signature reaches the probe after its answer: the count is read once it has
        # stayed the same for a second.)
        entries, steady_since, deadline = -1, time.time(), time.time() + 15
        while time.time() < deadline and time.time() - steady_since < 1.0:
            now = stack.metric("probe", "moeline_probe_index_entries")
            if now != entries:
                entries, steady_since = now, time.time()
            time.sleep(0.1)
        check(entries >= 2, f"index holds {entries} entries")
        old = stack.kill("probe", signal.SIGTERM)
        stack.wait_restarted("probe", old)
        stack.wait_healthy(30, "the stack did not become healthy after the probe's restart")
        rebuilt = {}
        wait_for(lambda: rebuilt.update(n=stack.metric("probe", "moeline_probe_index_entries"))
                 or rebuilt["n"] == entries, 10,
                 lambda: f"the restarted probe did not rebuild its index from disk: "
                 f"{rebuilt.get('n')} entries, {entries} before")
        with Client(stack.endpoint, timeout=120) as client:
            again = list(near)
            again[35] = (again[35] + 1) % vocab
            result = client.generate(tokens=again, max_tokens=8, tenant="t1", reuse="response")
            check(result.usage["approximate"] == "response",
                  f"after the probe restart: {result.usage}")
        print(f"ok approximate: after a probe restart its index ({int(entries)} entries) is "
              "rebuilt from the disk tier and serves")

    # The alternative metrics: Jaccard over the chosen experts per layer (similarity in [0, 1]).
    config["probe"]["approximate-metric"] = "jaccard"
    with Stack(args.moeline, args.model, os.path.join(args.workdir, "jaccard"),
               config=config) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            client.generate(tokens=donor, max_tokens=8, tenant="t1")
            served = client.generate(tokens=near, max_tokens=8, tenant="t1", reuse="approximate")
            check(served.usage["approximate"] == "response" and
                  0.0 <= served.usage["similarity"] <= 1.0, f"jaccard: {served.usage}")
    out = subprocess.run([args.moeline, "probe", "--approximate-metric", "manhattan"],
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 2 and "--approximate-metric" in out.stderr, out.stderr)
    print(f"ok approximate: the Jaccard metric serves (similarity "
          f"{served.usage['similarity']:.3f}); an unknown metric is refused at start")


def generate_donor(stack, client, **request):
    """Generates a donor's answer and waits until the probe has indexed its signature: prefill
    sends the first token (for a short answer, all of it) before the signature goes to the probe,
    so a query sent at once could miss it."""
    indexed = stack.metric("probe", "moeline_probe_index_entries")
    result = client.generate(**request)
    deadline = time.time() + 10
    while stack.metric("probe", "moeline_probe_index_entries") <= indexed:
        check(time.time() < deadline, f"the donor was never indexed: {request}")
        time.sleep(0.05)
    return result


def first_token_pairs(client, vocab, rng, want_agree, want_disagree):
    """Donor/query pairs whose full computations give the same first token (agree) or not."""
    agree, disagree = [], []
    for _ in range(200):
        if len(agree) >= want_agree and len(disagree) >= want_disagree:
            break
        donor = [rng.randrange(vocab) for _ in range(24)]
        query = list(donor)
        query[rng.randrange(8, 23)] = rng.randrange(vocab)
        a = client.generate(tokens=donor, max_tokens=1, tenant="reference", reuse="none").ids
        b = client.generate(tokens=query, max_tokens=1, tenant="reference", reuse="none").ids
        (agree if a == b else disagree).append((donor, query))
    check(len(agree) >= want_agree and len(disagree) >= want_disagree,
          f"found {len(agree)} agreeing and {len(disagree)} disagreeing pairs")
    return agree[:want_agree], disagree[:want_disagree]


def rollback_stack(args, name, gateway, probe):
    config = {"gateway": {"reuse-levels": "all", "approximate-min-lookups": 100000,
                          "approximate-min-checks": 100000, "approximate-min-served": 100000,
                          **gateway},
              "probe": {**OPEN_RULE, **probe}}
    return Stack(args.moeline, args.model, os.path.join(args.workdir, name), config=config)


def after_rollback(args, stack, client, reason, trigger_time, exact_prompt):
    """The state says off, with the reason, everywhere it is shown; exact reuse still works; an
    operator turns it on again."""
    _, state = wait_until_off(args.moeline, stack.endpoint, 30)
    took = time.time() - trigger_time  # from the triggering request's end to seeing it off
    check(state["reason"] == reason, f"off for {state['reason']}, want {reason}")
    check(took < 30, f"the change took {took:.1f} s to show")
    check(stack.metric("gateway", "moeline_gateway_approximate_enabled") == 0,
          "the metric still says on")
    check(stack.metric("gateway", "moeline_gateway_approximate_transitions_total",
                       reason=reason) == 1, "no transition counted")
    out = subprocess.run([args.moeline, "stack", "status", "--run-dir", stack.run_dir],
                         capture_output=True, text=True, timeout=30)
    check(f"approximate reuse: off ({reason})" in out.stdout, out.stdout)
    refused = client.generate(tokens=exact_prompt, max_tokens=4, tenant="fresh",
                              reuse="approximate")
    check(refused.usage["approximate"] == "disabled", f"still approximate: {refused.usage}")
    repeat = client.generate(tokens=exact_prompt, max_tokens=4, tenant="fresh",
                             reuse="approximate")
    check(repeat.usage["reuse_level"] == "result",
          f"exact reuse stopped working after the rollback: {repeat.usage}")
    out = subprocess.run([args.moeline, "client", "approximate", "--endpoint", stack.endpoint,
                          "on"], capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, out.stderr)
    check(approximate_state(args.moeline, stack.endpoint)["enabled"], "the operator's on failed")
    print(f"ok rollback: {reason} turned approximate reuse off, shown {took:.2f} s after the "
          "trigger; exact reuse kept working; an operator turned it on again")


def case_rollback(args):
    from moeline_client import Client
    vocab = vocab_of(args.model)
    rng = random.Random(23)
    exact_prompt = [rng.randrange(vocab) for _ in range(20)]

    # Low hit rate: nothing to reuse in fresh tenants, for a whole (2 s) window.
    gateway = {"approximate-hit-window-s": 2, "approximate-min-lookups": 4}
    with rollback_stack(args, "rollback-hits", gateway, {}) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            time.sleep(2.1)  # a whole window since the gateway started
            for i in range(4):  # min-lookups: the fourth one's plan turns it off
                prompt = [rng.randrange(vocab) for _ in range(20)]
                result = client.generate(tokens=prompt, max_tokens=2, tenant=f"lonely{i}",
                                         reuse="approximate")
                check(result.usage["approximate"] == "no_candidate", f"{result.usage}")
            after_rollback(args, stack, client, "low_hit_rate", time.time(), exact_prompt)

    # Agreement drop: every hit is shadowed (computed in full, first token compared); the first
    # two agree (the baseline: 100%), the third does not (67% over the window).
    gateway = {"approximate-min-checks": 2, "approximate-agreement-window-s": 120,
               "shadow-tokens": 1}
    with rollback_stack(args, "rollback-agree", gateway,
                        {"approximate-shadow-fraction": 1}) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            agree, disagree = first_token_pairs(client, vocab, rng, 2, 1)
            for i, (donor, query) in enumerate(agree + disagree):
                generate_donor(stack, client, tokens=donor, max_tokens=1, tenant=f"pair{i}")
                result = client.generate(tokens=query, max_tokens=1, tenant=f"pair{i}",
                                         reuse="approximate")
                check(result.usage["approximate"] == "shadow", f"pair {i}: {result.usage}")
                check(result.usage["reuse_level"] != "response",
                      "a shadowed request was not computed in full")
            # The outcomes reach the probe's decision rule too (asynchronously).
            deadline = time.time() + 10
            while stack.metric("probe", "moeline_probe_shadow_checks_total",
                               result="disagreed") < 1:
                check(time.time() < deadline, "the probe did not learn the shadow checks")
                time.sleep(0.05)
            after_rollback(args, stack, client, "agreement_drop", time.time(), exact_prompt)

            # A blend's shadow check: prefill computes the blend and the full prompt, serves the
            # full one (identical to `moeline run`) and reports how the blend compared.
            # (A donor long enough to blend: a block of its KV past the exact prefix.)
            donor = [rng.randrange(vocab) for _ in range(40)]
            generate_donor(stack, client, tokens=donor, max_tokens=1, tenant="pair0")
            query = list(donor)
            query[20] = (query[20] + 1) % vocab  # a prompt this stack has not seen
            seeded = {"max_tokens": 6, "temperature": 0.9, "seed": 77}
            result = client.generate(tokens=query, tenant="pair0", reuse="blend", **seeded)
            check(result.usage["approximate"] == "shadow", f"blend shadow: {result.usage}")
            want = reference(args.moeline, args.model, 6, tokens=query, temperature=0.9, seed=77)
            check(result.ids == want["ids"], "a blend shadow did not serve the full computation")
            check(stack.metric("prefill-0", "moeline_prefill_blend_shadow_total") == 1,
                  "prefill did not shadow the blend")
            # Response shadows also measured the first-token distributions at the probe.
            top1 = sum(stack.metric("probe", "moeline_probe_shadow_top1_total", result=r)
                       for r in ("agreed", "disagreed"))
            check(top1 >= 3, f"{top1} response shadows measured at the probe")
            print("ok rollback: a blend's shadow serves the full computation and reports the "
                  "comparison; response shadows are measured at the probe too")

    # Negative feedback on answers served by response reuse.
    gateway = {"approximate-min-served": 2, "approximate-feedback-window-s": 120}
    with rollback_stack(args, "rollback-feedback", gateway, {}) as stack:
        with Client(stack.endpoint, timeout=120) as client:
            donor = [rng.randrange(vocab) for _ in range(24)]
            generate_donor(stack, client, tokens=donor, max_tokens=4, tenant="fb")
            for position in (10, 15):
                query = list(donor)
                query[position] = (query[position] + 1) % vocab
                result = client.generate(tokens=query, max_tokens=4, tenant="fb",
                                         reuse="approximate")
                check(result.usage["approximate"] == "response", f"{result.usage}")
                client.feedback(result.client_request_id, -1.0, "wrong answer")
            trigger = time.time()
            after_rollback(args, stack, client, "negative_feedback", trigger, exact_prompt)


CASES = {"approximate": case_approximate, "rollback": case_rollback}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
