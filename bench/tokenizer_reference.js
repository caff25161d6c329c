// The Hugging Face tokenizers library (Node.js binding, tests/parity/node_modules) measured the
// way bench/tokenizer_bench.cpp measures moeline: median load time, cold first encode, median of
// the repeated encodes, one thread, one JSON object out.
//   node tokenizer_reference.js NODE_MODULES TOKENIZER_JSON TEXT_FILE REPEAT
const fs = require("fs");
const path = require("path");

async function main() {
  const [nodeModules, tokenizerPath, textPath, repeatArg] = process.argv.slice(2);
  const { Tokenizer } = require(path.resolve(nodeModules, "@anush008/tokenizers"));
  const repeat = Math.max(1, parseInt(repeatArg || "5", 10));
  const text = fs.readFileSync(textPath, "utf8");
  const median = (v) => v.slice().sort((a, b) => a - b)[Math.floor(v.length / 2)];
  const now = () => Number(process.hrtime.bigint()) / 1e6;
  const loads = [];
  let tok;
  for (let r = 0; r < repeat; r++) {
    const t0 = now();
    tok = Tokenizer.fromFile(tokenizerPath);
    loads.push(now() - t0);
  }
  const times = [];
  let tokens = 0;
  for (let r = 0; r < repeat + 1; r++) {
    const t0 = now();
    const enc = await tok.encode(text, null, { addSpecialTokens: true });
    times.push(now() - t0);
    tokens = enc.getLength();
  }
  const lines = text.split("\n").filter((l) => l.length > 0);
  const lineBytes = lines.reduce((n, l) => n + Buffer.byteLength(l, "utf8"), 0);
  const lineTimes = [];
  for (let r = 0; r < repeat; r++) {
    const t0 = now();
    for (const l of lines) await tok.encode(l, null, { addSpecialTokens: true });
    lineTimes.push(now() - t0);
  }
  const mb = Buffer.byteLength(text, "utf8") / 1e6;
  const cold = times.shift();
  console.log(JSON.stringify({ engine: "tokenizers (HF, node)", vocab: tok.getVocabSize(true),
    load_ms: median(loads), bytes: Buffer.byteLength(text, "utf8"), tokens,
    encode_cold_mb_s: mb / (cold / 1e3), encode_mb_s: mb / (median(times) / 1e3),
    lines: lines.length, encode_lines_mb_s: lineBytes / 1e6 / (median(lineTimes) / 1e3) }));
}

main().catch((e) => { console.error(e); process.exit(1); });
