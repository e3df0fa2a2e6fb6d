// mlx-bun behind spec-parity's file protocol (docs/protocol.md, "The file protocol"):
//
//   bun run examples/mlx_bun/port.ts CASE OUT
//
// CASE is a case folder (request.json, inputs.safetensors, target/, drafter/); the answer goes
// to OUT/outputs.safetensors. MLX_BUN_DIR names the patched mlx-bun tree and MLX_BUN_LIBMLXC
// its libmlxc (examples/mlx_bun/setup.sh prints both). Exit 3 with one line on stderr declines
// a case mlx-bun cannot run; exit 2 is misuse.
//
// What runs is mlx-bun's own code: GemmaAssistantDrafter.forward for assistant steps,
// specGenerate for assistant loops, createModel for targets. The drafter's per-layer outputs
// and head scores are read through the `taps` hook of our patch (patches/mlx-bun-drafter-taps).

import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import { join } from "node:path";

type Arr = { dtype: "F32" | "I32"; shape: number[]; data: Float32Array | Int32Array };
type Inputs = Record<string, Arr>;

class Declined extends Error {}

function fail(code: number, line: string): never {
  process.stderr.write(`${line.replace(/\s+/g, " ")}\n`);
  process.exit(code);
}

function readSafetensors(path: string): Inputs {
  const buf = readFileSync(path);
  const n = Number(buf.readBigUInt64LE(0));
  const header = JSON.parse(buf.subarray(8, 8 + n).toString("utf8"));
  const out: Inputs = {};
  for (const [name, m] of Object.entries<any>(header)) {
    if (name === "__metadata__") continue;
    const [b, e] = m.data_offsets;
    const bytes = buf.subarray(8 + n + b, 8 + n + e);
    const copy = new Uint8Array(bytes).buffer;
    if (m.dtype === "F32") out[name] = { dtype: "F32", shape: m.shape, data: new Float32Array(copy) };
    else if (m.dtype === "I32") out[name] = { dtype: "I32", shape: m.shape, data: new Int32Array(copy) };
  }
  return out;
}

/** Written beside, then renamed: the harness never reads half a file. */
function writeSafetensors(path: string, arrays: Inputs): void {
  const header: Record<string, unknown> = {};
  let offset = 0;
  const names = Object.keys(arrays).sort();
  for (const name of names) {
    const a = arrays[name]!;
    header[name] = { dtype: a.dtype, shape: a.shape, data_offsets: [offset, offset + a.data.byteLength] };
    offset += a.data.byteLength;
  }
  let json = JSON.stringify(header);
  json += " ".repeat((8 - (json.length % 8)) % 8);
  const out = Buffer.alloc(8 + json.length + offset);
  out.writeBigUInt64LE(BigInt(json.length), 0);
  out.write(json, 8, "utf8");
  let at = 8 + json.length;
  for (const name of names) {
    const d = arrays[name]!.data;
    Buffer.from(d.buffer, d.byteOffset, d.byteLength).copy(out, at);
    at += d.byteLength;
  }
  writeFileSync(`${path}.tmp`, out);
  renameSync(`${path}.tmp`, path);
}

const f32 = (shape: number[], data: Float32Array): Arr => ({ dtype: "F32", shape, data });
const i32 = (shape: number[], data: number[]): Arr => ({ dtype: "I32", shape, data: Int32Array.from(data) });

/** The dtype a checkpoint's floating tensors are stored in (mlx-bun computes in it). */
function storedDtype(dir: string): string {
  const names: Record<string, string> = { F32: "float32", BF16: "bfloat16", F16: "float16" };
  const buf = readFileSync(join(dir, "model.safetensors"));
  const header = JSON.parse(buf.subarray(8, 8 + Number(buf.readBigUInt64LE(0))).toString("utf8"));
  const kinds = new Set(Object.values<any>(header).map((m) => names[m?.dtype]).filter(Boolean));
  return kinds.size === 1 ? [...kinds][0]! : [...kinds].join("+");
}

async function mlxBun(root: string) {
  const at = (p: string) => import(join(root, "src", p));
  return {
    array: await at("mlx/array.ts"),
    ops: await at("mlx/ops.ts"),
    drafter: await at("spec/drafter.ts"),
    generate: await at("spec/generate.ts"),
    factory: await at("model/factory.ts"),
    config: await at("config.ts"),
    weights: await at("weights.ts"),
  };
}
type Lib = Awaited<ReturnType<typeof mlxBun>>;

/** mlx-bun's own model for a checkpoint; its refusal to load one is a decline. */
async function loadTarget(lib: Lib, dir: string) {
  const raw = JSON.parse(readFileSync(join(dir, "config.json"), "utf8"));
  if (!raw.quantization && !raw.text_config?.quantization)
    throw new Declined("the case's target is a dense checkpoint: mlx-bun's target models load "
      + "quantized weights only (their linears and embedding read *.scales; no dense path)");
  const config = await lib.config.loadModelConfig(dir);
  return lib.factory.createModel(await lib.weights.Weights.open(dir), config);
}

function toF32(lib: Lib, a: any): Float32Array {
  const c = lib.ops.contiguous(a);
  const out = c.toFloat32();
  c.dispose();
  return out;
}

/** The head's scores as full-vocabulary logits: the tied head scores every row; the centroid
 *  head scores only its candidates, the rest are -1e30 (the value optiq fills them with). */
function headLogits(lib: Lib, taps: any, vocab: number): Float32Array {
  const scores = toF32(lib, taps.scores);
  if (!taps.candidates) return scores;
  const ids = toF32(lib, taps.candidates);
  const full = new Float32Array(vocab).fill(-1e30);
  ids.forEach((id, i) => { full[id] = scores[i]!; });
  return full;
}

/** assistant/step: GemmaAssistantDrafter.forward chained from the fed anchor and donors. */
async function assistantStep(lib: Lib, req: any, dir: string, inputs: Inputs): Promise<Inputs> {
  if (!inputs["in.anchor.token"]) {
    await loadTarget(lib, join(dir, "target"));
    throw new Declined("the case feeds no anchor (in.*): the shim runs no target prefill");
  }
  const stored = storedDtype(join(dir, "drafter"));
  if (stored !== req.dtype)
    throw new Declined(`mlx-bun computes in the drafter's stored dtype (${stored}); `
      + `the case asks ${req.dtype} and mlx-bun has no cast on load`);
  const { MlxArray } = lib.array;
  const drafter = await lib.drafter.GemmaAssistantDrafter.load(join(dir, "drafter"));
  const arr = (a: Arr) => MlxArray.fromFloat32(a.data as Float32Array, a.shape);
  const table = inputs["in.embed_table"]!;
  const [vocab, width] = table.shape as [number, number];
  const embed = (token: number) =>
    MlxArray.fromFloat32((table.data as Float32Array).slice(token * width, (token + 1) * width), [1, 1, width]);
  const shared = {
    sliding: [arr(inputs["in.donor.sliding.k"]!), arr(inputs["in.donor.sliding.v"]!)],
    full: [arr(inputs["in.donor.full.k"]!), arr(inputs["in.donor.full.v"]!)],
  };
  // specGenerate hands forward the target's last position (cache offset - 1); in.position is
  // the offset, the next position.
  const position = inputs["in.position"]!.data[0]! - 1;
  let token = inputs["in.anchor.token"]!.data[0]!;
  let hidden = arr(inputs["in.anchor.hidden"]!);
  const out: Inputs = {};
  const step0 = { token, hidden };
  for (let k = 0; k < req.options.gamma; k++) {
    drafter.taps = { feed: [], layers: [], scores: null, candidates: null };
    const emb = embed(token);
    const step = drafter.forward(emb, hidden, shared, position + k);
    out[`step${k}.token`] = i32([1], [step.token]);
    out[`step${k}.logits`] = f32([vocab], headLogits(lib, drafter.taps, vocab));
    out[`step${k}.next_hidden`] = f32([1, 1, width], toF32(lib, step.nextHidden));
    if (k === 0)
      drafter.taps.layers.forEach((h: any, i: number) => {
        out[`layer.${i}`] = f32([1, h.shape[2]], toF32(lib, h));
      });
    token = step.token;
    hidden = step.nextHidden;
  }
  // The own-error run: step 0 again, each layer i >= 1 fed the reference's layer.{i-1}.
  const layers = Object.keys(out).filter((n) => n.startsWith("layer.")).length;
  const ref = (i: number) => inputs[`layer.${i}`];
  if (ref(layers - 2)) {
    const fed = (a: Arr) => MlxArray.fromFloat32(a.data as Float32Array, [1, 1, a.shape[1]!]);
    const feed = [undefined, ...Array.from({ length: layers - 1 }, (_, i) => fed(ref(i)!))];
    drafter.taps = { feed, layers: [], scores: null, candidates: null };
    drafter.forward(embed(step0.token), step0.hidden, shared, position);
    drafter.taps.layers.forEach((h: any, i: number) => {
      out[`own.${i}`] = i === 0 ? out["layer.0"]! : f32([1, h.shape[2]], toF32(lib, h));
    });
  }
  drafter.taps = null;
  return out;
}

/** assistant/loop: specGenerate, mlx-bun's serve loop, at T=0. */
async function assistantLoop(lib: Lib, req: any, dir: string, inputs: Inputs): Promise<Inputs> {
  const model = await loadTarget(lib, join(dir, "target"));
  const drafter = await lib.drafter.GemmaAssistantDrafter.load(join(dir, "drafter"));
  const prompt = Array.from(inputs.prompt!.data);
  const o = req.options;
  const res = lib.generate.specGenerate(model, drafter, prompt, {
    gamma: o.gamma, maxTokens: o.max_tokens, eosTokenIds: o.eos < 0 ? [] : [o.eos],
  });
  return { "stream.tokens": i32([res.tokens.length], res.tokens) };
}

async function answer(caseDir: string, req: any): Promise<Inputs> {
  const inputs = readSafetensors(join(caseDir, "inputs.safetensors"));
  if (req.module === "dspark" || req.module === "dflash")
    throw new Declined(`mlx-bun's ${req.module} (src/spec/dspark/) is its own architecture with its `
      + "own checkpoint format (dspark.json, bb.*/W_c names, no RoPE): no z-lab or DeepSpec "
      + "checkpoint loads into it");
  if (req.module === "assistant" && req.kind === "sampled")
    throw new Declined("mlx-bun's specGenerate is greedy only: it has no sampler at T > 0");
  const root = process.env.MLX_BUN_DIR;
  if (!root || !existsSync(join(root, "src", "spec", "drafter.ts")))
    fail(2, "MLX_BUN_DIR does not name a patched mlx-bun tree: run examples/mlx_bun/setup.sh "
      + "and export what it prints");
  process.env.MLX_BUN_FUSED_GELU ??= "0";
  const lib = await mlxBun(root);
  if (req.module === "assistant" && req.kind === "step") return assistantStep(lib, req, caseDir, inputs);
  if (req.module === "assistant" && req.kind === "loop") return assistantLoop(lib, req, caseDir, inputs);
  if (req.module === "targets") {
    await loadTarget(lib, join(caseDir, "target"));
    throw new Declined("the shim runs no target forward yet");
  }
  throw new Declined(`no mlx-bun counterpart for ${req.module}/${req.kind}`);
}

async function main(argv: string[]): Promise<void> {
  if (argv.length !== 2) fail(2, "usage: bun run examples/mlx_bun/port.ts CASE OUT");
  const [caseDir, outDir] = argv as [string, string];
  const reqPath = join(caseDir, "request.json");
  if (!existsSync(reqPath)) fail(2, `${reqPath} not found: CASE must be a case folder (spec-parity export)`);
  const req = JSON.parse(readFileSync(reqPath, "utf8"));
  let out: Inputs;
  try {
    out = await answer(caseDir, req);
  } catch (e) {
    if (e instanceof Declined) fail(3, e.message);
    throw e;
  }
  mkdirSync(outDir, { recursive: true });
  writeSafetensors(join(outDir, "outputs.safetensors"), out);
}

await main(process.argv.slice(2));
