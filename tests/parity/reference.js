// Reference side of the tokenizer parity test: runs the Hugging Face `tokenizers` library (its
// Node.js binding) over cases.json and prints what it produced as JSON.
//   node reference.js TOKENIZER_JSON CASES_JSON > reference.json
// cases.json: {"texts": [...], "random_sequences": N, "seed": S}
const fs = require("fs");
const { Tokenizer } = require("@anush008/tokenizers");

async function main() {
  const [tokenizerPath, casesPath] = process.argv.slice(2);
  const cases = JSON.parse(fs.readFileSync(casesPath, "utf8"));
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const out = { encode: [], encode_no_special: [], decode: [], decode_skip: [], random_ids: [],
                random_decode: [], random_decode_skip: [] };
  for (const text of cases.texts) {
    const withSpecial = (await tokenizer.encode(text, null, { addSpecialTokens: true })).getIds();
    const without = (await tokenizer.encode(text, null, { addSpecialTokens: false })).getIds();
    out.encode.push(withSpecial);
    out.encode_no_special.push(without);
    out.decode.push(await tokenizer.decode(withSpecial, false));
    out.decode_skip.push(await tokenizer.decode(withSpecial, true));
  }
  // Random id sequences over the whole vocabulary: byte-fallback pieces, stray continuation
  // bytes and special tokens in odd places exercise the decoders' error paths.
  const size = tokenizer.getVocabSize(true);
  let state = BigInt(cases.seed || 1);
  const next = () => {
    state = (state * 6364136223846793005n + 1442695040888963407n) & ((1n << 64n) - 1n);
    return Number(state >> 33n);
  };
  for (let k = 0; k < (cases.random_sequences || 0); k++) {
    const ids = [];
    const length = 1 + (next() % 24);
    while (ids.length < length) {
      const id = next() % size;
      if (tokenizer.idToToken(id) !== null) ids.push(id);
    }
    out.random_ids.push(ids);
    out.random_decode.push(await tokenizer.decode(ids, false));
    out.random_decode_skip.push(await tokenizer.decode(ids, true));
  }
  process.stdout.write(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
