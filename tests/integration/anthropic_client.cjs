// The official Anthropic client library (npm `@anthropic-ai/sdk`) against moeline's HTTP front:
// what an application written for Anthropic's Messages API sees. Prints one JSON object of
// results for test_http.py to check.
//
//   node anthropic_client.cjs NODE_MODULES BASE_URL MODEL text|tools
//
// text: a message whole, streamed (the library's MessageStream and the raw events), its prompt
// counted, and the errors the library raises. tools: a forced tool_use, whole and streamed (the
// input rebuilt from input_json_delta), its tool_result sent back, and the tools counted.
const path = require("path");

const [nodeModules, baseURL, model, mode] = process.argv.slice(2);
const library = require(path.join(nodeModules, "@anthropic-ai", "sdk"));
const Anthropic = library.Anthropic || library.default || library;

function textOf(message) {
  return message.content.filter((b) => b.type === "text").map((b) => b.text).join("");
}

async function failure(request) {
  try {
    await request;
    return null;
  } catch (e) {
    return { status: e.status, name: e.constructor.name, type: e.error?.error?.type ?? null,
             message: e.error?.error?.message ?? null };
  }
}

async function text(client) {
  const messages = [{ role: "user", content: "a person who" }];
  const asked = { model, max_tokens: 40, temperature: 0, messages };
  const message = await client.messages.create(asked);
  const out = {
    message: { type: message.type, role: message.role, text: textOf(message),
               stop_reason: message.stop_reason, usage: message.usage } };
  out.models = [];
  for await (const listed of client.models.list()) out.models.push({ id: listed.id, type: listed.type });
  const stream = client.messages.stream(asked);
  let deltas = "";
  stream.on("text", (piece) => { deltas += piece; });
  const final = await stream.finalMessage();
  out.stream = { text: textOf(final), deltas, stop_reason: final.stop_reason, usage: final.usage };
  const events = [];
  for await (const event of await client.messages.create({ ...asked, stream: true }))
    events.push(event.type);
  out.events = events;
  out.count = (await client.messages.countTokens({ model, messages })).input_tokens;
  out.unknown_model = await failure(client.messages.create({ ...asked, model: "no-such-model" }));
  out.bad_request = await failure(client.messages.create({ ...asked, max_tokens: 0 }));
  return out;
}

async function tools(client) {
  const tools = [{ name: "get_weather", description: "A city's weather",
                   input_schema: { type: "object", properties: { city: { enum: ["Paris", "Rome"] } },
                                   required: ["city"] } }];
  const messages = [{ role: "user", content: "Weather in Paris?" }];
  const asked = { model, max_tokens: 60, temperature: 0, messages, tools,
                  tool_choice: { type: "tool", name: "get_weather" } };
  const message = await client.messages.create(asked);
  const call = message.content.find((b) => b.type === "tool_use") ?? null;
  const streamed = await client.messages.stream(asked).finalMessage();
  const out = {
    stop_reason: message.stop_reason, call,
    streamed: { stop_reason: streamed.stop_reason,
                call: streamed.content.find((b) => b.type === "tool_use") ?? null } };
  if (call) {
    const follow = await client.messages.create({
      model, max_tokens: 4, temperature: 0, tools,
      messages: [...messages, { role: "assistant", content: message.content },
                 { role: "user", content: [{ type: "tool_result", tool_use_id: call.id,
                                             content: "sunny" }] }] });
    out.follow = { type: follow.type, stop_reason: follow.stop_reason };
  }
  out.counts = [(await client.messages.countTokens({ model, messages, tools })).input_tokens,
                (await client.messages.countTokens({ model, messages })).input_tokens];
  return out;
}

async function main() {
  const client = new Anthropic({ baseURL, apiKey: "unused-on-an-open-stack", maxRetries: 0 });
  const out = mode === "tools" ? await tools(client) : await text(client);
  console.log(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
