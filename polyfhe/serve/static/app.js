// The page's encrypted-inference panel: keys made here, images encrypted here, results decrypted here.
// The server gets the public context and ciphertexts only; the secret key stays in this browser's IndexedDB.
import { ClientError, PageClient, checkRange, checkSpec, imageToInput, softmax } from "./fheclient.js";

const $ = (id) => document.getElementById(id);
const DB_NAME = "polyfhe-keys";
const STORE = "keys";
const TOP_K = 5;
const state = { seal: null, models: [], model: null, spec: null, client: null, record: null };
window.polyfhePage = state;  // for people and tests: lastInput, lastLogits, lastClass, timings

const mb = (bytes) => (bytes / 1e6).toFixed(1) + " MB";
const ms = (t) => (t < 1000 ? t.toFixed(0) + " ms" : (t / 1000).toFixed(2) + " s");

function say(text) { $("page-status").textContent = text; }
function fail(error) {
  const message = error instanceof ClientError || error instanceof ApiFailure ? error.message : String(error);
  $("page-error").textContent = message;
  $("page-error").hidden = false;
  say("");
  setBusy(false);
}
function setBusy(busy) {
  for (const id of ["make-keys", "delete-keys", "classify", "page-model"]) $(id).disabled = busy || (id !== "page-model" && !state.spec);
  document.body.dataset.busy = busy ? "1" : "";
}

// ---------------------------------------------------------------------------------------------------------------
// IndexedDB: one record per program id {program_id, model, secret_key, created, session_id}

function db() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE, { keyPath: "program_id" });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}
async function keyStore(mode, action) {
  const handle = await db();
  return new Promise((resolve, reject) => {
    const tx = handle.transaction(STORE, mode);
    const request = action(tx.objectStore(STORE));
    tx.oncomplete = () => { handle.close(); resolve(request.result); };
    tx.onerror = () => { handle.close(); reject(tx.error); };
  });
}
const loadRecord = (programId) => keyStore("readonly", (s) => s.get(programId));
const saveRecord = (record) => keyStore("readwrite", (s) => s.put(record));
const deleteRecord = (programId) => keyStore("readwrite", (s) => s.delete(programId));

// ---------------------------------------------------------------------------------------------------------------
// The server

class ApiFailure extends Error {
  constructor(status, body) {
    super(body && body.detail ? `server: ${body.detail} (${status})` : `server answered ${status}`);
    this.status = status;
  }
}
function authHeaders() {
  const token = sessionStorage.getItem("polyfhe-token");
  return token ? { Authorization: "Bearer " + token } : {};
}
async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  if (!response.ok) {
    let body = null;
    try { body = await response.json(); } catch (e) { /* not JSON */ }
    throw new ApiFailure(response.status, body);
  }
  return response;
}

// ---------------------------------------------------------------------------------------------------------------
// Models and keys

async function seal() {
  if (!state.seal) {
    say("loading SEAL (WebAssembly, 1.3 MB)…");
    const factory = (await import("./vendor/node-seal/seal_throws.js")).default;
    state.seal = await factory();
  }
  return state.seal;
}

async function chooseModel(name) {
  $("page-error").hidden = true;
  state.model = state.models.find((m) => m.name === name) || null;
  state.spec = state.client = state.record = null;
  $("result").replaceChildren();
  if (!state.model) return;
  const spec = await (await api(`/v1/models/${encodeURIComponent(name)}/client-spec`)).json();
  state.spec = await checkSpec(spec, state.model.program_id);
  $("upload-size").textContent = `public keys to upload: about ${mb(spec.upload.public_context_bytes)} ` +
    `(${spec.upload.galois_keys} rotation keys, N=${spec.ring.poly_modulus_degree}); ` +
    `each image: ${mb(spec.upload.ciphertext_bytes)} encrypted` +
    (spec.upload.within_budget ? "" : ` (over the ${mb(spec.upload.budget_bytes)} a page should upload: ` +
      "export the program with --for-browser for fewer rotation keys)");
  $("upload-size").dataset.bytes = String(spec.upload.public_context_bytes);
  $("classes").textContent = spec.classes.join(", ");
  state.record = (await loadRecord(spec.program_id)) || null;
  showKeys();
  setBusy(false);
}

function showKeys() {
  const r = state.record;
  $("key-status").textContent = !r ? "no keys for this model in this browser yet: they are made when you classify"
    : `keys from ${new Date(r.created).toLocaleString()} are kept in this browser` +
      (state.client ? ` (made in ${ms(r.keygen_ms)})` : "");
  $("key-status").dataset.keys = r ? "saved" : "none";
}

async function makeKeys() {
  const sealModule = await seal();
  say(`making keys (N=${state.spec.ring.poly_modulus_degree}, ${state.spec.galois_steps.length} rotation keys)…`);
  await new Promise((r) => setTimeout(r, 20));  // let the page paint before WebAssembly holds the thread
  if (state.client) state.client.delete();
  state.client = new PageClient(sealModule, state.spec);
  state.record = { program_id: state.spec.program_id, model: state.model.name, secret_key: state.client.saveSecretKey(),
                   created: Date.now(), keygen_ms: state.client.keygenMs, session_id: null };
  await saveRecord(state.record);
  state.timings = { keygen_ms: state.client.keygenMs };
  showKeys();
}

async function ensureClient() {
  if (state.client) return;
  if (!state.record) return makeKeys();
  const sealModule = await seal();
  say("restoring your keys…");
  await new Promise((r) => setTimeout(r, 20));
  state.client = new PageClient(sealModule, state.spec, state.record.secret_key);
  showKeys();
}

async function ensureSession() {
  const r = state.record;
  if (r.session_id) {
    try {
      await api(`/v1/sessions/${encodeURIComponent(r.session_id)}`);
      return r.session_id;  // the server still holds our public keys
    } catch (e) {
      if (!(e instanceof ApiFailure) || (e.status !== 404 && e.status !== 410)) throw e;
    }
  }
  const context = state.client.publicContext();
  say(`uploading ${mb(context.length)} of public keys…`);
  const t0 = performance.now();
  const answer = await (await api(`/v1/sessions?model=${encodeURIComponent(state.model.name)}`, {
    method: "POST", headers: { "Content-Type": "application/octet-stream" }, body: new Blob([context]) })).json();
  if (answer.program_id !== state.spec.program_id) throw new ClientError("the server opened a session for another program");
  state.timings.upload_ms = performance.now() - t0;
  state.timings.context_bytes = context.length;
  r.session_id = answer.session_id;
  await saveRecord(r);
  return r.session_id;
}

async function deleteKeys() {
  const r = state.record;
  if (r && r.session_id) { try { await api(`/v1/sessions/${encodeURIComponent(r.session_id)}`, { method: "DELETE" }); } catch (e) { /* gone */ } }
  if (state.spec) await deleteRecord(state.spec.program_id);
  if (state.client) state.client.delete();
  state.client = state.record = null;
  showKeys();
  say("keys deleted from this browser");
}

// ---------------------------------------------------------------------------------------------------------------
// The image: drawn or dropped on the canvas, then reduced to the model's input

const canvas = () => $("draw");
function clearCanvas() {
  state.sourceImage = null;
  const ctx = canvas().getContext("2d");
  ctx.fillStyle = "#000";
  ctx.fillRect(0, 0, canvas().width, canvas().height);
}
function setupDrawing() {
  const c = canvas();
  const ctx = c.getContext("2d");
  let drawing = false;
  const at = (e) => { const b = c.getBoundingClientRect(); return [(e.clientX - b.left) * c.width / b.width, (e.clientY - b.top) * c.height / b.height]; };
  c.addEventListener("pointerdown", (e) => { drawing = true; state.sourceImage = null; ctx.beginPath(); ctx.moveTo(...at(e)); c.setPointerCapture(e.pointerId); });
  c.addEventListener("pointermove", (e) => {
    if (!drawing) return;
    ctx.lineWidth = c.width / 12; ctx.lineCap = ctx.lineJoin = "round"; ctx.strokeStyle = "#fff";
    ctx.lineTo(...at(e)); ctx.stroke();
  });
  c.addEventListener("pointerup", () => { drawing = false; });
  c.addEventListener("dragover", (e) => e.preventDefault());
  c.addEventListener("drop", (e) => { e.preventDefault(); if (e.dataTransfer.files[0]) drawFile(e.dataTransfer.files[0]); });
  $("file").addEventListener("change", () => { if ($("file").files[0]) drawFile($("file").files[0]); });
  $("clear").addEventListener("click", clearCanvas);
  clearCanvas();
}
async function drawFile(file) {
  try {
    const image = await createImageBitmap(file);
    clearCanvas();
    const ctx = canvas().getContext("2d");
    ctx.imageSmoothingEnabled = image.width < canvas().width ? false : true;  // small images stay crisp
    ctx.drawImage(image, 0, 0, canvas().width, canvas().height);
    state.sourceImage = image;  // the model gets the file itself, resized once (not the canvas's enlargement)
    say(`image ${file.name} (${image.width} x ${image.height}) loaded; it is encrypted before it leaves this page`);
  } catch (e) { fail(new ClientError(`cannot read ${file.name} as an image`)); }
}

// The canvas reduced to the model's input: channel-major intensities in [0, 1] (grayscale: luminance).
function canvasInput(spec) {
  const { channels, height, width } = spec.input;
  if (!channels || channels * height * width !== spec.input.size || (channels !== 1 && channels !== 3)) {
    throw new ClientError(`the page feeds images (1 or 3 channels); this program takes input of shape ${spec.input.shape.join(" x ")}`);
  }
  const small = document.createElement("canvas");
  small.width = width; small.height = height;
  const ctx = small.getContext("2d");
  ctx.imageSmoothingEnabled = true; ctx.imageSmoothingQuality = "high";
  ctx.drawImage(state.sourceImage || canvas(), 0, 0, width, height);
  const rgba = ctx.getImageData(0, 0, width, height).data;
  const out = new Float64Array(channels * height * width);
  for (let p = 0; p < height * width; p++) {
    const [r, g, b] = [rgba[4 * p], rgba[4 * p + 1], rgba[4 * p + 2]];
    if (channels === 1) out[p] = (0.299 * r + 0.587 * g + 0.114 * b) / 255;
    else { out[p] = r / 255; out[height * width + p] = g / 255; out[2 * height * width + p] = b / 255; }
  }
  const preview = $("input-preview");
  preview.width = width; preview.height = height;
  preview.getContext("2d").drawImage(small, 0, 0);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Classify: encrypt here, evaluate there, decrypt here

async function classify() {
  $("page-error").hidden = true;
  setBusy(true);
  const start = performance.now();
  try {
    state.timings = {};
    await ensureClient();
    const values = imageToInput(state.spec, canvasInput(state.spec));
    checkRange(state.spec, values);
    await ensureSession();
    say("encrypting…");
    await new Promise((r) => setTimeout(r, 0));
    let t0 = performance.now();
    const query = state.client.encrypt(values);
    state.timings.encrypt_ms = performance.now() - t0;
    say(`sending ${mb(query.length)} of ciphertext; the server computes on it without a key…`);
    t0 = performance.now();
    let response;
    try {
      response = await api(`/v1/sessions/${encodeURIComponent(state.record.session_id)}/infer`, {
        method: "POST", headers: { "Content-Type": "application/octet-stream" }, body: query });
    } catch (e) {
      if (!(e instanceof ApiFailure) || (e.status !== 404 && e.status !== 410)) throw e;
      state.record.session_id = null;  // expired meanwhile: upload the keys again, once
      await ensureSession();
      response = await api(`/v1/sessions/${encodeURIComponent(state.record.session_id)}/infer`, {
        method: "POST", headers: { "Content-Type": "application/octet-stream" }, body: query });
    }
    const answer = new Uint8Array(await response.arrayBuffer());
    state.timings.round_trip_ms = performance.now() - t0;
    state.timings.server_s = parseFloat(response.headers.get("X-Polyfhe-Server-Seconds"));
    t0 = performance.now();
    const logits = state.client.decrypt(answer);
    state.timings.decrypt_ms = performance.now() - t0;
    state.timings.total_ms = performance.now() - start;
    state.timings.query_bytes = query.length;
    state.timings.answer_bytes = answer.length;
    state.lastInput = values;
    state.lastLogits = logits;
    showResult(logits);
    say("");
  } catch (e) { fail(e); return; }
  setBusy(false);
}

function showResult(logits) {
  const scores = softmax(logits);
  const order = Array.from(scores.keys()).sort((a, b) => scores[b] - scores[a]).slice(0, TOP_K);
  state.lastClass = order[0];
  const list = document.createElement("ol");
  list.id = "top";
  for (const i of order) {
    const li = document.createElement("li");
    li.dataset.class = String(i);
    const bar = document.createElement("span"); bar.className = "bar"; bar.style.width = (100 * scores[i]).toFixed(1) + "%";
    const label = document.createElement("span"); label.className = "label";
    label.textContent = `${state.spec.classes[i]}: ${(100 * scores[i]).toFixed(1)} % (logit ${logits[i].toFixed(3)})`;
    li.append(bar, label);
    list.append(li);
  }
  const t = state.timings;
  const facts = document.createElement("p");
  facts.id = "timings";
  facts.textContent = [`server ${t.server_s.toFixed(3)} s`, `round trip ${ms(t.round_trip_ms)}`,
    `encrypt ${ms(t.encrypt_ms)}`, `decrypt ${ms(t.decrypt_ms)}`, `end to end ${ms(t.total_ms)}`,
    `sent ${mb(t.query_bytes)}`, t.upload_ms ? `keys uploaded: ${mb(t.context_bytes)} in ${ms(t.upload_ms)}` : "keys already on the server"].join(" · ");
  const result = $("result");
  result.replaceChildren(list, facts);
  result.dataset.class = String(order[0]);
  result.dataset.done = String(Date.now());
}

// ---------------------------------------------------------------------------------------------------------------

async function init() {
  setupDrawing();
  $("page-model").addEventListener("change", () => chooseModel($("page-model").value).catch(fail));
  $("make-keys").addEventListener("click", async () => { setBusy(true); try { await makeKeys(); say("new keys made and kept in this browser"); } catch (e) { fail(e); return; } setBusy(false); });
  $("delete-keys").addEventListener("click", async () => { setBusy(true); try { await deleteKeys(); } catch (e) { fail(e); return; } setBusy(false); });
  $("classify").addEventListener("click", classify);
  $("token").addEventListener("change", () => sessionStorage.setItem("polyfhe-token", $("token").value.trim()));
  try {
    state.models = (await (await api("/v1/models")).json()).models;
    const select = $("page-model");
    const options = state.models.map((m) => {
      const o = document.createElement("option");
      o.value = m.name;
      o.textContent = m.browser ? m.name : `${m.name} (${m.browser_client.split(":")[0]})`;
      o.disabled = !m.browser;
      o.title = m.browser_client;
      return o;
    });
    select.replaceChildren(...options);
    const first = state.models.find((m) => m.browser);
    if (!first) { say("no model here has a browser client: use the CLI below"); setBusy(false); return; }
    select.value = first.name;
    await chooseModel(first.name);
    document.body.dataset.ready = "1";
  } catch (e) { fail(e); }
}

init();
