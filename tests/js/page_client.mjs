// Drives the web page's client (polyfhe/serve/static/fheclient.js) under Node for the interop tests: the same
// module and the same vendored node-seal 7.0.0 the page loads, on files a Python test writes and reads.
//
//   node page_client.mjs keys DIR      spec.json -> context.bin (public context), secret.bin, keys.json
//   node page_client.mjs encrypt DIR   spec.json, secret.bin, inputs.json -> query_I.bin, packed_I.bin (float64)
//   node page_client.mjs decrypt DIR   spec.json, secret.bin, answer_I.bin... -> logits.json
import { readFileSync, writeFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import factory from "../../polyfhe/serve/static/vendor/node-seal/seal_throws.js";
import { PageClient, checkSpec, packInput } from "../../polyfhe/serve/static/fheclient.js";

const [command, dir] = process.argv.slice(2);
const seal = await factory();
const spec = await checkSpec(JSON.parse(readFileSync(join(dir, "spec.json"), "utf8")));
const read = (name) => new Uint8Array(readFileSync(join(dir, name)));

if (command === "keys") {
  const client = new PageClient(seal, spec);
  const context = client.publicContext();
  writeFileSync(join(dir, "context.bin"), context);
  writeFileSync(join(dir, "secret.bin"), client.saveSecretKey());
  writeFileSync(join(dir, "keys.json"), JSON.stringify({ keygen_ms: client.keygenMs, context_bytes: context.length }));
} else if (command === "encrypt") {
  const client = new PageClient(seal, spec, read("secret.bin"));
  JSON.parse(readFileSync(join(dir, "inputs.json"), "utf8")).forEach((values, i) => {
    writeFileSync(join(dir, `query_${i}.bin`), client.encrypt(values));
    const packed = packInput(spec, values);
    const flat = new Float64Array(packed.length * spec.ring.slots);
    packed.forEach((v, k) => flat.set(v, k * spec.ring.slots));
    writeFileSync(join(dir, `packed_${i}.bin`), new Uint8Array(flat.buffer));
  });
} else if (command === "decrypt") {
  const client = new PageClient(seal, spec, read("secret.bin"));
  const names = readdirSync(dir).filter((n) => /^answer_\d+\.bin$/.test(n))
    .sort((a, b) => parseInt(a.slice(7), 10) - parseInt(b.slice(7), 10));
  const logits = names.map((n) => Array.from(client.decrypt(read(n))));
  writeFileSync(join(dir, "logits.json"), JSON.stringify(logits));
} else {
  console.error(`unknown command ${command}: keys, encrypt or decrypt`);
  process.exit(2);
}
