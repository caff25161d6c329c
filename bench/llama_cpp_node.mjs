// llama.cpp on a GGUF file, timed as llama-bench times it (pp: one prompt of N tokens in one
// batch; tg: N tokens decoded one at a time from a one-token context; best of R after a warm-up;
// with DEPTH, both after DEPTH tokens already in the context, untimed, as llama-bench's -d),
// through node-llama-cpp's prebuilt CPU build of llama.cpp (npm, bench/package.json), for hosts
// without a llama.cpp build of their own. Prints llama-bench's `-o json` fields that
// bench/report.py reads.
//
//   node bench/llama_cpp_node.mjs MODEL.gguf THREADS PROMPT DECODE REPEAT [DEPTH]
import {getLlama} from "node-llama-cpp";

const [path, threadsArg, promptArg, decodeArg, repeatArg, depthArg] = process.argv.slice(2);
const threads = Number(threadsArg), prompt = Number(promptArg), decode = Number(decodeArg);
const repeat = Number(repeatArg ?? 3), depth = Number(depthArg ?? 0);

const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path});
// Ordinary tokens of any vocabulary of more than 1100 (ids past the specials).
const tokens = Array.from({length: prompt}, (_, i) => 100 + ((i * 7919) % 1000));
const context_tokens = Array.from({length: depth}, (_, i) => 100 + ((i * 104729 + 7) % 1000));

async function timed(run) {
  const context = await model.createContext({contextSize: depth + Math.max(prompt, decode) + 16,
                                             batchSize: Math.max(prompt, depth, 1), threads});
  const sequence = context.getSequence();
  if (depth > 0) await sequence.evaluateWithoutGeneratingNewTokens(context_tokens);
  const start = performance.now();
  await run(sequence);
  const seconds = (performance.now() - start) / 1000;
  await context.dispose();
  return seconds;
}

async function prefill(sequence) {
  await sequence.evaluateWithoutGeneratingNewTokens(tokens);
}

async function generate(sequence) {
  // One token of context, then `decode` tokens, each its own forward pass (greedy).
  let produced = 0;
  for await (const token of sequence.evaluate([tokens[0]], {temperature: 0})) {
    void token;
    if (++produced >= decode) break;
  }
}

function best(samples) { return Math.min(...samples); }

const results = [];
for (const [name, run, count] of [["pp", prefill, prompt], ["tg", generate, decode]]) {
  await timed(run);  // warm-up
  const samples = [];
  for (let r = 0; r < repeat; ++r) samples.push(await timed(run));
  const seconds = best(samples);
  results.push({n_threads: threads, n_prompt: name === "pp" ? prompt : 0,
                n_gen: name === "tg" ? decode : 0, n_depth: depth, avg_ts: count / seconds,
                samples_ts: samples.map((s) => count / s), build: "node-llama-cpp prebuilt"});
}
console.log(JSON.stringify(results));
await model.dispose();
await llama.dispose();
