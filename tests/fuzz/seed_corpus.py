#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz corpus (tests/fuzz/corpus/<harness>/seed-*), deterministically,
from the golden wire buffers, the embedded demo model and small hand-made files. Inputs the fuzzers
found later live beside them and are kept.

  seed_corpus.py [--models DIR]   DIR: generated test models (build/tests/models) for configs
"""

import argparse
import glob
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")


def write(harness, name, data):
    folder = os.path.join(CORPUS, harness)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "seed-" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def golden_frames(path):
    """A golden buffer (u32-length frames) in the wire harness's u16-length frames."""
    with open(path, "rb") as f:
        blob = f.read()
    out, at = b"", 0
    while at + 4 <= len(blob):
        n = struct.unpack_from("<I", blob, at)[0]
        frame = blob[at + 4:at + 4 + n]
        at += 4 + n
        out += struct.pack("<H", min(len(frame), 0xffff)) + frame[:0xffff]
    return out


def safetensors(tensors):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.join(ROOT, "build", "tests", "models"))
    args = ap.parse_args()
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "compat", "v1.5", "*.bin"))):
        write("wire", os.path.basename(path), golden_frames(path))
    write("safetensors", "small", safetensors([
        ("a.weight", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
        ("b.weight", "BF16", [4], b"\x80\x3f" * 4),
        ("c.weight", "F16", [1, 2], b"\x00\x3c" * 2)]))
    write("safetensors", "metadata", safetensors([("x", "F32", [1], b"\x00" * 4)]).replace(
        b'{"x"', b'{"__metadata__": {"format": "pt"}, "x"'))
    demo = os.path.join(ROOT, "models", "demo-qwen3-moe")
    for name in ("config.json",):
        with open(os.path.join(demo, name), "rb") as f:
            write("config", "demo-" + name, f.read())
    for path in sorted(glob.glob(os.path.join(args.models, "*", "config.json"))):
        with open(path, "rb") as f:
            write("config", os.path.basename(os.path.dirname(path)), f.read())
    for model in ("mixtral-f32", "qwen3-f32"):
        path = os.path.join(args.models, model, "tokenizer.json")
        if os.path.exists(path):
            with open(path, "rb") as f:
                write("tokenizer", model, f.read())
    write("tokenizer", "minimal", json.dumps({
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
        "added_tokens": [], "pre_tokenizer": None, "normalizer": None, "decoder": None}))
    write("chat_template", "conversation", json.dumps([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "volcano:"},
        {"role": "assistant", "content": "a mountain"}, {"role": "user", "content": "héllo 🌋"}]))
    write("chat_template", "text", "to swim: <|im_start|>user\n\x00\xff")
    write("records", "prompt", b"\x00" + struct.pack("<II", 2, 0) + struct.pack("<2f", 0.5, -1))
    write("records", "result", b"\x01" + struct.pack("<II", 3, 4) + struct.pack("<3i", 5, 6, 7) +
          b"stop")
    write("records", "signature", b"\x02" + struct.pack("<IIIII", 0x4749534d, 2, 2, 4, 0) +
          struct.pack("<2i2f", 1, 2, 0.5, 0.5) + b"ns:x" + struct.pack("<I", 0))
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import gguf_reference as gguf
    import numpy as np
    rng = np.random.default_rng(0)
    tensors = [(f"t.{gguf.NAMES[kind]}", kind, [256, 2], gguf.random_blocks(kind, 512, rng))
               for kind in gguf.BLOCKS]
    path = os.path.join(CORPUS, "gguf", "seed-every-type")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    gguf.write_gguf(path, [("general.architecture", gguf.STRING, "qwen3moe"),
                           ("general.alignment", gguf.U32, 32),
                           ("a", gguf.ARRAY, (gguf.ARRAY, [(gguf.I32, [1, 2])]))], tensors)
    write("records", "quality", b"\x03" + struct.pack("<i?f", 3, True, 0.01))
    openai_seeds()


def openai_seeds():
    """Request bodies of each endpoint and answers in pieces (fuzz_openai.cpp's layout)."""
    def framed(flags, body, *pieces):
        out = bytes([flags])
        for part in (body, *pieces):
            data = part.encode()
            out += struct.pack("<H", len(data)) + data
        return out

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    chat = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [tool], "tool_choice": "auto", "stream": True,
        "stream_options": {"include_usage": True}, "stop": ["END"], "logprobs": True,
        "top_logprobs": 2, "response_format": {"type": "json_object"}, "seed": 1, "n": 2})
    write("openai", "chat-hermes", framed(0, chat, "<think>\nhm</thi", "nk>\n\n<tool_",
                                          "call>\n{\"name\": \"get_weather\", \"argu",
                                          "ments\": {\"city\": \"Paris\"}}\n</tool_call>"))
    write("openai", "chat-glm", framed(4 | 16, chat, "Sure.<tool_call>get_weather\n<arg_key>",
                                       "days</arg_key><arg_value>3</arg_value></tool_call>"))
    write("openai", "chat-deepseek", framed(
        32, chat, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool",
        "▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"))
    write("openai", "responses", framed(
        64, json.dumps({"input": [{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "input_text",
                                                                "text": "hi"}]},
                                  {"type": "function_call", "call_id": "c1", "name": "f",
                                   "arguments": "{}"},
                                  {"type": "function_call_output", "call_id": "c1",
                                   "output": "ok"}],
                        "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto",
                        "text": {"format": {"type": "json_object"}}, "stream": True}),
        'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"ind',
        'ex":0,"delta":{"role":"assistant","reasoning_content":"hm"},"finish_reason":null}]}\n\n',
        'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n: k\n\n',
        'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"c2","function":{"name":"f",'
        '"arguments":"{}"}}]},"finish_reason":"tool_calls"}]}\n\ndata: {"choices":[],"usage":'
        '{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n'))
    write("openai", "messages", framed(
        128, json.dumps({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be"}],
                         "messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": [
                                          {"type": "thinking", "thinking": "hm"},
                                          {"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {"a": 1}}]},
                                      {"role": "user", "content": [
                                          {"type": "tool_result", "tool_use_id": "t1",
                                           "content": [{"type": "text", "text": "ok"}]}]}],
                         "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                         "tool_choice": {"type": "any"}, "thinking": {"type": "enabled"},
                         "stop_sequences": ["END"], "stream": True}),
        'data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"role":"assistant","reasoni',
        'ng_content":"hm"},"finish_reason":null}],"usage":{"prompt_tokens":3}}\n\n: k\n\n',
        'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n',
        'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"c2","function":{"name":"f",'
        '"arguments":"{}"}}]},"finish_reason":"stop","stop_reason":"END"}]}\n\ndata: {"error":'
        '{"message":"x","type":"timeout_error"}}\n\ndata: [DONE]\n\n'))
    write("openai", "chat-mistral", framed(
        32 | 4, chat, "Sure. [TOOL_", "CALLS] [{\"name\": \"get_weather\", \"arguments\": ",
        "{\"city\": \"Paris\"}}]"))
    write("openai", "chat-mistral-v11", framed(
        32 | 4 | 16, chat, "[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": ",
        "\"Paris\"}[TOOL_CALLS]now[ARGS]{}"))
    completion = json.dumps({"prompt": ["a", "b"], "max_tokens": 8, "echo": True, "logprobs": 3,
                             "logit_bias": {"5": -100}, "best_of": 2, "n": 2, "top_p": 0.9,
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "n", "schema": {"type": "object"}}}})
    write("openai", "completion", framed(1, completion, "some text", " END more"))
    # vLLM's fields: min_tokens beside five stop strings (one inside another), guided_json as
    # text, continue_final_message, return_tokens_as_token_ids.
    continued = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
        "continue_final_message": True, "min_tokens": 2, "max_tokens": 8, "logprobs": True,
        "return_tokens_as_token_ids": True, "stop": ["ab", "b", "END", "xEN", "\n\n"]})
    write("openai", "chat-continued", framed(16, continued, "a", "b", "xE", "ND", "ab"))
    guided = json.dumps({"prompt": "x", "max_tokens": 8, "guided_json": json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}}),
        "structured_outputs": {"disable_any_whitespace": True}})
    write("openai", "completion-guided", framed(1, guided, "{\"a\": 1}"))
    write("openai", "generate", framed(2, json.dumps({"prompt": "x", "max_tokens": 4}), "y"))
    write("openai", "tokenize", framed(3, json.dumps({"prompt": "x", "tokens": [1, 2]})))


if __name__ == "__main__":
    main()
