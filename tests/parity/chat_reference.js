// Reference side of the chat-template test: renders a tokenizer_config.json's Jinja chat template
// with @huggingface/jinja (the engine transformers.js uses) for each case in cases.json.
//   node chat_reference.js TOKENIZER_CONFIG_JSON CASES_JSON > rendered.json
const fs = require("fs");
const { Template } = require("@huggingface/jinja");

const [configPath, casesPath] = process.argv.slice(2);
const config = JSON.parse(fs.readFileSync(configPath, "utf8"));
const cases = JSON.parse(fs.readFileSync(casesPath, "utf8"));
const tokenString = (t) => (t && typeof t === "object" ? t.content : t) || "";
let source = config.chat_template;
if (Array.isArray(source)) source = source.find((t) => t.name === "default").template;
const template = new Template(source);
const out = cases.map((c) => {
  const context = { messages: c.messages, add_generation_prompt: c.add_generation_prompt,
                    bos_token: tokenString(config.bos_token), eos_token: tokenString(config.eos_token) };
  if (c.enable_thinking !== undefined) context.enable_thinking = c.enable_thinking;
  try {
    return template.render(context);
  } catch (e) {
    return { error: String(e) };
  }
});
process.stdout.write(JSON.stringify(out));
