// The official `openai` client library (npm) against moeline's HTTP front: what an application
// that speaks OpenAI sees. Prints one JSON object of results for test_http.py to check.
//
//   node openai_client.cjs NODE_MODULES BASE_URL MODEL BIASED_TOKEN
const path = require("path");

const [nodeModules, baseURL, model, biasedToken] = process.argv.slice(2);
const library = require(path.join(nodeModules, "openai"));
const OpenAI = library.OpenAI || library.default || library;

async function main() {
  const client = new OpenAI({ baseURL, apiKey: "unused-on-an-open-stack", maxRetries: 0 });
  const out = {};
  const models = await client.models.list();
  out.models = models.data.map((m) => m.id);

  const messages = [{ role: "user", content: "a person who" }];
  const chat = await client.chat.completions.create({ model, messages, temperature: 0,
                                                      max_tokens: 40 });
  out.chat = { content: chat.choices[0].message.content, role: chat.choices[0].message.role,
               finish_reason: chat.choices[0].finish_reason, usage: chat.usage };

  const stream = await client.chat.completions.create({
    model, messages, temperature: 0, max_tokens: 40, stream: true,
    stream_options: { include_usage: true } });
  let text = "";
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length > 0) {
      text += chunk.choices[0].delta.content ?? "";
      if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  out.stream = { content: text, finish_reason: finish, usage };

  // Penalties and log-probabilities, as the library sends and types them.
  const scored = await client.chat.completions.create({
    model, messages, temperature: 0, max_tokens: 12, presence_penalty: 0.6, logprobs: true,
    top_logprobs: 2 });
  out.logprobs = {
    content: scored.choices[0].message.content,
    entries: scored.choices[0].logprobs.content.map((e) => ({
      token: e.token, logprob: e.logprob, bytes: e.bytes, top: e.top_logprobs.length })),
    usage: scored.usage };

  const completion = await client.completions.create({ model, prompt: "(botany) a plant",
                                                       temperature: 0, max_tokens: 40,
                                                       stop: ["Acanth"] });
  out.completion = { text: completion.choices[0].text,
                     finish_reason: completion.choices[0].finish_reason };

  // A logit bias that pushes BIASED_TOKEN out.
  const biased = await client.completions.create({ model, prompt: "(botany) a plant",
                                                   temperature: 0, max_tokens: 12,
                                                   logit_bias: { [biasedToken]: -100 } });
  out.biased = { text: biased.choices[0].text };

  // n choices, whole and streamed (the library gathers a stream's chunks by choice index).
  const several = await client.completions.create({ model, prompt: "(botany) a plant", n: 2,
                                                    temperature: 0.9, seed: 7, max_tokens: 12 });
  const streamed = ["", ""];
  const choices = await client.completions.create({ model, prompt: "(botany) a plant", n: 2,
                                                    temperature: 0.9, seed: 7, max_tokens: 12,
                                                    stream: true });
  for await (const chunk of choices)
    for (const choice of chunk.choices) streamed[choice.index] += choice.text;
  out.choices = { texts: several.choices.map((c) => c.text),
                  indices: several.choices.map((c) => c.index), streamed,
                  completion_tokens: several.usage.completion_tokens };

  // Echo with logprobs (how lm-evaluation-harness scores a continuation).
  const echoed = await client.completions.create({ model, prompt: "(botany) a plant",
                                                   temperature: 0, max_tokens: 1, echo: true,
                                                   logprobs: 1 });
  out.echo = { text: echoed.choices[0].text,
               token_logprobs: echoed.choices[0].logprobs.token_logprobs };

  // The Responses API: whole, as raw events, and through the library's stream helper, which
  // rebuilds the response from the events and throws on any it cannot place.
  const response = await client.responses.create({ model, input: "a person who", temperature: 0,
                                                   max_output_tokens: 40 });
  const events = await client.responses.create({ model, input: "a person who", temperature: 0,
                                                 max_output_tokens: 40, stream: true });
  let deltas = "";
  const types = [];
  for await (const event of events) {
    types.push(event.type);
    if (event.type === "response.output_text.delta") deltas += event.delta;
  }
  const helper = client.responses.stream({ model, input: "a person who", temperature: 0,
                                           max_output_tokens: 40 });
  const rebuilt = await helper.finalResponse();
  out.responses = { output_text: response.output_text, status: response.status,
                    usage: response.usage, deltas, first: types[0], last: types[types.length - 1],
                    rebuilt_text: rebuilt.output_text, rebuilt_status: rebuilt.status };

  try {
    await client.chat.completions.create({ model: "no-such-model", messages });
    out.unknown_model = { status: 200 };
  } catch (error) {
    out.unknown_model = { status: error.status, code: error.code, type: error.type,
                          param: error.param, name: error.constructor.name };
  }
  try {
    await client.chat.completions.create({ model, messages, max_tokens: "ten" });
    out.wrong_type = { status: 200 };
  } catch (error) {
    out.wrong_type = { status: error.status, param: error.param, name: error.constructor.name };
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((error) => {
  process.stderr.write(`openai_client: ${error.stack || error}\n`);
  process.exit(1);
});
