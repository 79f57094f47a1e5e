// polyfhe's CKKS client for the web page (and Node): keys, input packing, containers, decryption.
//
// It does what polyfhe's Python client (polyfhe/engines/seal/client.py) does, with node-seal 7.0.0 (Microsoft
// SEAL 4.1.2 in WebAssembly) instead of TenSEAL: the same ring, the same slot packing
// (polyfhe/runtime/execute.py pack_single), the same byte containers (polyfhe/program/wire.py). The secret key
// never leaves this module except through saveSecretKey(), which the page stores in IndexedDB only.
// Everything here is pure: no DOM, no network; the page (app.js) and the Node tests drive it.

export const SPEC_FORMAT = "polyfhe-client-spec/1";
const MAGIC = "PFHE01";
const KIND_CONTEXT = "P";
const KIND_CIPHERTEXT = "C";
const MAX_HEADER = 1 << 20;

export class ClientError extends Error {}

// ---------------------------------------------------------------------------------------------------------------
// The spec: checked before anything is made from it.

// Python's json.dumps(obj, sort_keys=True) for the plain values a parameter set holds (ints, strings, lists).
export function pythonJson(value) {
  if (Array.isArray(value)) return "[" + value.map(pythonJson).join(", ") + "]";
  if (value !== null && typeof value === "object") {
    return "{" + Object.keys(value).sort().map((k) => JSON.stringify(k) + ": " + pythonJson(value[k])).join(", ") + "}";
  }
  if (typeof value === "number" && !Number.isInteger(value)) throw new ClientError("parameters hold only integers");
  return JSON.stringify(value);
}

async function sha256Hex(text) {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

// The fingerprint polyfhe puts in every container header (polyfhe/program/params.py fingerprint_params).
export async function fingerprintParams(params) {
  return (await sha256Hex(pythonJson(params))).slice(0, 16);
}

// Refuse a spec that is not for this page's format, not for a browser, or whose parameters do not hash to the
// fingerprint the server checks: keys made from it would be refused (or worse, silently wrong).
export async function checkSpec(spec, programId) {
  if (!spec || spec.format !== SPEC_FORMAT) throw new ClientError(`unknown client spec format ${spec && spec.format}`);
  if (!spec.browser) throw new ClientError(spec.reason || "this program has no browser client");
  if (programId !== undefined && spec.program_id !== programId) {
    throw new ClientError(`the spec is for program ${spec.program_id}, the model runs ${programId}`);
  }
  if (spec.identity.program_id !== spec.program_id) throw new ClientError("the spec's identity names another program");
  const fingerprint = await fingerprintParams(spec.params);
  if (fingerprint !== spec.identity.params) {
    throw new ClientError(`the spec's parameters hash to ${fingerprint}, its identity says ${spec.identity.params}`);
  }
  const ring = spec.ring;
  if (ring.poly_modulus_degree !== spec.params.poly_modulus_degree || ring.slots * 2 !== ring.poly_modulus_degree ||
      ring.scale !== 2 ** spec.params.scale_bits || pythonJson(ring.coeff_mod_bits) !== pythonJson(spec.params.coeff_mod_bits)) {
    throw new ClientError("the spec's ring disagrees with its parameters");
  }
  if (spec.layout === "single") {
    const p = spec.packing;
    const lanes = p.samples_per_ciphertext;
    if (p.virtual_slots * lanes !== ring.slots || p.virtual_slots % p.period !== 0) {
      throw new ClientError("the spec's packing does not tile the ring");
    }
    if (p.input_slots.some((s) => s < 0 || s >= p.period)) throw new ClientError("an input slot lies outside the period");
    const gather = p.input_gather.length ? p.input_gather : null;
    if (gather ? gather.length !== p.input_slots.length : p.input_slots.length !== spec.input.size) {
      throw new ClientError("the spec's packing does not place every input element");
    }
  } else if (spec.layout !== "batch") {
    throw new ClientError(`unknown layout ${spec.layout}`);
  }
  return spec;
}

// ---------------------------------------------------------------------------------------------------------------
// Containers: MAGIC | kind | u32 LE header length | JSON header (with "sections": [[name, length], ...]) | sections

export function packContainer(kind, header, sections) {
  const head = { ...header, sections: sections.map(([name, bytes]) => [name, bytes.length]) };
  const raw = new TextEncoder().encode(JSON.stringify(head));
  const total = MAGIC.length + 5 + raw.length + sections.reduce((n, [, b]) => n + b.length, 0);
  const out = new Uint8Array(total);
  out.set(new TextEncoder().encode(MAGIC), 0);
  out[MAGIC.length] = kind.charCodeAt(0);
  new DataView(out.buffer).setUint32(MAGIC.length + 1, raw.length, true);
  let at = MAGIC.length + 5;
  out.set(raw, at);
  at += raw.length;
  for (const [, bytes] of sections) { out.set(bytes, at); at += bytes.length; }
  return out;
}

export function unpackContainer(data, kind) {
  const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
  const start = MAGIC.length + 5;
  if (bytes.length < start || new TextDecoder().decode(bytes.subarray(0, MAGIC.length)) !== MAGIC) {
    throw new ClientError("not a polyfhe container (bad magic)");
  }
  if (String.fromCharCode(bytes[MAGIC.length]) !== kind) throw new ClientError(`expected a container of kind ${kind}`);
  const size = new DataView(bytes.buffer, bytes.byteOffset).getUint32(MAGIC.length + 1, true);
  if (size > MAX_HEADER || start + size > bytes.length) throw new ClientError("container header is truncated");
  let header;
  try { header = JSON.parse(new TextDecoder().decode(bytes.subarray(start, start + size))); }
  catch (e) { throw new ClientError("container header is not JSON"); }
  if (!header || typeof header !== "object" || !Array.isArray(header.sections)) {
    throw new ClientError("container header lists no sections");
  }
  const sections = new Map();
  let at = start + size;
  for (const [name, length] of header.sections) {
    if (typeof name !== "string" || !Number.isInteger(length) || length < 0 || at + length > bytes.length) {
      throw new ClientError(`container section ${name} is truncated`);
    }
    sections.set(name, bytes.subarray(at, at + length));
    at += length;
  }
  if (at !== bytes.length) throw new ClientError("container has trailing bytes");
  delete header.sections;
  return { header, sections };
}

// ---------------------------------------------------------------------------------------------------------------
// Packing: one sample's values -> the slot vector the program reads (exactly pack_single / the batch columns).

export function packInput(spec, values) {
  if (values.length !== spec.input.size) {
    throw new ClientError(`the program takes ${spec.input.size} values, got ${values.length}`);
  }
  for (const v of values) if (!Number.isFinite(v)) throw new ClientError("input holds NaN or infinite values");
  const slots = spec.ring.slots;
  if (spec.layout === "batch") {
    return Array.from(values, (v) => { const col = new Float64Array(slots); col[0] = v; return col; });
  }
  const p = spec.packing;
  const lanes = p.samples_per_ciphertext;
  const row = new Float64Array(p.period);  // sample 0's lane of the (lanes x period) grid
  p.input_slots.forEach((slot, i) => { row[slot] = values[p.input_gather.length ? p.input_gather[i] : i]; });
  const vec = new Float64Array(slots);
  for (let u = 0; u < p.virtual_slots; u++) vec[u * lanes] = row[u % p.period];  // sample j=0 at u*lanes + 0
  return [vec];
}

export function unpackOutput(spec, vectors) {
  if (spec.layout === "batch") return Float64Array.from(vectors, (v) => v[0]);
  const lanes = spec.packing.samples_per_ciphertext;
  return Float64Array.from(spec.output.slots, (u) => vectors[0][u * lanes]);
}

// Model input from an image's pixels: intensities in [0, 1] (channel-major), then (x - mean) / std.
export function imageToInput(spec, intensities) {
  const { mean, std } = spec.input;
  return Float64Array.from(intensities, (x) => (x - mean) / std);
}

export function softmax(logits) {
  const top = Math.max(...logits);
  const e = Array.from(logits, (v) => Math.exp(v - top));
  const sum = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / sum);
}

// The input range the program was calibrated for: outside it CKKS results overflow silently, so refuse.
export function checkRange(spec, values) {
  const [lo, hi] = spec.input.range;
  const span = Math.max(hi - lo, 1e-12);
  let min = Infinity, max = -Infinity;
  for (const v of values) { if (v < min) min = v; if (v > max) max = v; }
  if (min < lo - 0.05 * span || max > hi + 0.05 * span) {
    throw new ClientError(`input values [${min.toPrecision(3)}, ${max.toPrecision(3)}] fall outside the range ` +
      `[${lo.toPrecision(3)}, ${hi.toPrecision(3)}] the program was calibrated for`);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Keys and ciphertexts with node-seal. All SEAL objects travel uncompressed (the server bounds them exactly) and in
// SEAL 4.1's format, which polyfhe's server reads and answers in for this client.

function makeContext(seal, ring) {
  const parms = new seal.EncryptionParameters(seal.SchemeType.ckks);
  parms.setPolyModulusDegree(ring.poly_modulus_degree);
  parms.setCoeffModulus(seal.CoeffModulus.Create(ring.poly_modulus_degree, Int32Array.from(ring.coeff_mod_bits)));
  const level = ring.security === "tc128" ? seal.SecLevelType.tc128 : seal.SecLevelType.none;
  const context = new seal.SEALContext(parms, true, level);
  if (!context.parametersSet()) throw new ClientError("SEAL refused the program's parameters");
  return context;
}

export class PageClient {
  // New keys, or (secretKeyBytes: what saveSecretKey() returned) the saved secret key with its evaluation keys
  // derived again from it.
  constructor(seal, spec, secretKeyBytes = null) {
    this.seal = seal;
    this.spec = spec;
    this.context = makeContext(seal, spec.ring);
    this.encoder = new seal.CKKSEncoder(this.context);
    const t0 = performance.now();
    let keygen;
    if (secretKeyBytes) {
      const saved = new seal.SecretKey();
      try { saved.loadFromArray(this.context, secretKeyBytes); }
      catch (e) { throw new ClientError("the saved secret key does not load for this program's parameters"); }
      keygen = new seal.KeyGenerator(this.context, saved);
      saved.delete();
    } else {
      keygen = new seal.KeyGenerator(this.context);
    }
    // Keys travel seeded: each key ciphertext's uniformly random half is sent as the 64-byte seed it came from,
    // about half the bytes (the server expands it, SEAL's own format). The public key object is the seeded one read back.
    const none = seal.ComprModeType.none;
    const save = (serializable) => { try { return serializable.saveToArray(none); } finally { serializable.delete(); } };
    this._secretKey = keygen.secretKey();
    this.keyBytes = { public_key: save(keygen.createPublicKeySerializable()),
                      relin_keys: save(keygen.createRelinKeysSerializable()) };
    if (spec.galois_steps.length) {
      this.keyBytes.galois_keys = save(keygen.createGaloisKeysSerializableWithSteps(Int32Array.from(spec.galois_steps)));
    }
    this.publicKey = new seal.PublicKey();
    this.publicKey.loadFromArray(this.context, this.keyBytes.public_key);
    keygen.delete();
    this.keygenMs = performance.now() - t0;
    this.encryptor = new seal.Encryptor(this.context, this.publicKey);
    this.decryptor = new seal.Decryptor(this.context, this._secretKey);
  }

  saveSecretKey() { return this._secretKey.saveToArray(this.seal.ComprModeType.none); }

  // Public key, relinearisation keys and exactly the program's Galois keys: what the server gets.
  publicContext() {
    const sections = ["public_key", "relin_keys", "galois_keys"].filter((n) => this.keyBytes[n]).map((n) => [n, this.keyBytes[n]]);
    const header = { ...this.spec.identity, params_full: this.spec.params, galois_steps: this.spec.galois_steps,
                     client: "polyfhe-page/1 node-seal 7.0.0" };
    return packContainer(KIND_CONTEXT, header, sections);
  }

  // One sample (the program's input values) -> the query container.
  encrypt(values) {
    const seal = this.seal;
    const sections = packInput(this.spec, values).map((vec, i) => {
      const pt = new seal.Plaintext();
      const ct = new seal.Ciphertext();
      try {
        this.encoder.encode(vec, this.spec.encrypt.scale, pt);  // at the top level (the context's first parms_id)
        this.encryptor.encrypt(pt, ct);
        return [`ct${i}`, ct.saveToArray(seal.ComprModeType.none)];
      } finally { pt.delete(); ct.delete(); }
    });
    const header = { ...this.spec.identity, role: "input", count: sections.length, samples: 1 };
    return packContainer(KIND_CIPHERTEXT, header, sections);
  }

  // The server's answer -> the logits of the one sample.
  decrypt(data) {
    const seal = this.seal;
    const { header, sections } = unpackContainer(data, KIND_CIPHERTEXT);
    if (header.program_id !== this.spec.program_id) {
      throw new ClientError(`the answer is for program ${header.program_id}, these keys are for ${this.spec.program_id}`);
    }
    const expected = this.spec.output.ciphertexts;
    if (header.count !== expected || sections.size !== expected || header.samples !== 1) {
      throw new ClientError(`the answer holds ${header.count} ciphertexts for ${header.samples} samples; expected ${expected} for 1`);
    }
    const vectors = [];
    for (let i = 0; i < expected; i++) {
      const bytes = sections.get(`ct${i}`);
      if (!bytes) throw new ClientError(`the answer lacks ct${i}`);
      const ct = new seal.Ciphertext();
      const pt = new seal.Plaintext();
      try {
        ct.loadFromArray(this.context, bytes);
        this.decryptor.decrypt(ct, pt);
        vectors.push(Float64Array.from(this.encoder.decodeFloat64(pt)));
      } catch (e) {
        if (e instanceof ClientError) throw e;
        throw new ClientError(`the answer's ciphertext ${i} does not load or decrypt: ${e && e.message ? e.message : e}`);
      } finally { ct.delete(); pt.delete(); }
    }
    return unpackOutput(this.spec, vectors);
  }

  delete() {
    for (const o of [this.encryptor, this.decryptor, this.publicKey, this._secretKey, this.encoder, this.context]) o.delete();
    this.keyBytes = null;
  }
}

