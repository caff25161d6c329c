// Validates Kubernetes objects against the API's schemas (kubernetes-models: the OpenAPI
// definitions of each apiVersion/kind, compiled). Reads multi-document YAML on stdin (what
// `kubectl kustomize` prints); prints one JSON line per object ({kind, name, ok, error}) and
// exits 1 when any object is invalid or of a kind it has no schema for.
import { readFileSync } from "node:fs";
import yaml from "js-yaml";

const docs = yaml.loadAll(readFileSync(0, "utf8")).filter((doc) => doc);
let failed = false;
for (const doc of docs) {
  const [group, version] = doc.apiVersion.includes("/") ? doc.apiVersion.split("/") : ["", doc.apiVersion];
  const module = `kubernetes-models/${group ? group + "/" : ""}${version}/${doc.kind}`;
  const name = doc.metadata?.name;
  let error = null;
  try {
    const models = await import(module);
    const Model = models[doc.kind] ?? models.default;
    new Model(doc).validate();
  } catch (e) {
    error = e.code === "ERR_MODULE_NOT_FOUND" ? `no schema for ${doc.apiVersion} ${doc.kind}` : String(e.message ?? e);
  }
  failed ||= error !== null;
  console.log(JSON.stringify({ kind: doc.kind, name, ok: error === null, error }));
}
process.exit(failed ? 1 : 0);
