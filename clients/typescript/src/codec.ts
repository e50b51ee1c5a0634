// Codec frames of docs/protocol.md §5: the 16-byte frame, fp32 / q8 / q4 value codecs and the
// zstd byte stage (decoded with fzstd; encoded as raw-block frames, §5.4).
import { crc32 } from "node:zlib";
import { decompress } from "fzstd";
import { createXXHash3, type IHasher } from "hash-wasm";

export class CodecError extends Error {}
/** A codec outside the core set this client implements (§9). */
export class UnsupportedCodec extends CodecError {}

const MAGIC = [0x47, 0x44]; // "GD"
const VERSION = 3;
export const HEADER_SIZE = 16;
const FLT_MAX = 3.4028234663852886e38;
const RAW_BLOCK_MAX = 131072;
const ZSTD_MAGIC = 0xfd2fb528;

type Values = { kind: "fp32" } | { kind: "q"; bits: 8 | 4; block: number };

export interface Codec {
  spec: string; // as the run config writes it (goes into ChunkHeader.codec)
  canonical: string;
  tag: number;
  values: Values;
  zstdLevel: number | null;
}

function positiveInt(text: string, what: string): number {
  if (!/^\d+$/.test(text) || Number(text) < 1) throw new UnsupportedCodec(`${what}: bad argument ${text}`);
  return Number(text);
}

/** Parse a spec of the core set (§5.1, §9); anything else is UnsupportedCodec. */
export function parseCodec(spec: string): Codec {
  const stages = spec.split("|").map((s) => s.trim()).filter((s) => s.length > 0);
  let zstdLevel: number | null = null;
  const last = stages[stages.length - 1]?.split(":").map((a) => a.trim());
  if (last && last[0] === "zstd" && stages.length > 1) {
    if (last.length > 2) throw new UnsupportedCodec(`${spec}: zstd takes one argument`);
    zstdLevel = last.length === 2 ? Number(last[1]) : 3;
    if (!Number.isInteger(zstdLevel)) throw new UnsupportedCodec(`${spec}: bad zstd level`);
    stages.pop();
  }
  if (stages.length !== 1) throw new UnsupportedCodec(`codec ${JSON.stringify(spec)} is outside this client's core set`);
  const [name, ...args] = stages[0].split(":").map((a) => a.trim());
  let values: Values;
  let text: string;
  if (name === "fp32" && args.length === 0) {
    values = { kind: "fp32" };
    text = "fp32";
  } else if ((name === "q8" || name === "q4") && args.length <= 1) {
    const block = args.length ? positiveInt(args[0], spec) : 128;
    values = { kind: "q", bits: name === "q8" ? 8 : 4, block };
    text = `${name}:${block}`;
  } else {
    throw new UnsupportedCodec(`codec ${JSON.stringify(spec)} is outside this client's core set`);
  }
  const canonical = zstdLevel === null ? text : `${text}|zstd:${zstdLevel}`;
  return { spec, canonical, tag: crc32(Buffer.from(canonical, "utf8")) >>> 0, values, zstdLevel };
}

// -- checksum ---------------------------------------------------------------------------------

let hasher: IHasher | null = null;

/** Low 32 bits of XXH3-64 (seed 0) of the body. */
export async function checksum(body: Uint8Array): Promise<number> {
  hasher ??= await createXXHash3(0, 0);
  hasher.init();
  hasher.update(body);
  const digest = hasher.digest("binary"); // big-endian 64-bit value
  return new DataView(digest.buffer, digest.byteOffset, 8).getUint32(4, false);
}

// -- value codecs -----------------------------------------------------------------------------

const GRID = { 8: { half: 127, offset: 0, top: 127 }, 4: { half: 7, offset: 7, top: 14 } } as const;

function nBlocks(n: number, block: number): number {
  return Math.ceil(n / block);
}

export function rawSize(codec: Codec, n: number): number {
  const v = codec.values;
  if (v.kind === "fp32") return 4 * n;
  return 4 * nBlocks(n, v.block) + (v.bits === 8 ? n : Math.ceil(n / 2));
}

function roundHalfEven(y: number): number {
  const f = Math.floor(y);
  const d = y - f;
  if (d < 0.5) return f;
  if (d > 0.5) return f + 1;
  return f % 2 === 0 ? f : f + 1;
}

function encodeValues(codec: Codec, x: Float32Array): Uint8Array {
  const n = x.length;
  const out = new Uint8Array(rawSize(codec, n));
  const view = new DataView(out.buffer);
  const v = codec.values;
  if (v.kind === "fp32") {
    x.forEach((value, i) => {
      if (!Number.isFinite(value)) throw new CodecError("tensor contains NaN or Inf");
      view.setFloat32(4 * i, value, true);
    });
    return out;
  }
  const { half, offset } = GRID[v.bits];
  const nb = nBlocks(n, v.block);
  const codes = new Int32Array(n);
  for (let b = 0; b < nb; b++) {
    const start = b * v.block;
    const end = Math.min(n, start + v.block);
    let absmax = 0;
    for (let i = start; i < end; i++) {
      const a = Math.abs(x[i]);
      if (!Number.isFinite(a)) throw new CodecError("tensor contains NaN or Inf");
      if (a > absmax) absmax = a;
    }
    const step = Math.fround(absmax / half);
    const inv = step > 0 ? Math.fround(1 / step) : 0;
    view.setFloat32(4 * b, step, true);
    for (let i = start; i < end; i++) {
      let y = Math.fround(x[i] * inv);
      if (offset) y = Math.fround(y + offset);
      codes[i] = roundHalfEven(y);
    }
  }
  const head = 4 * nb;
  if (v.bits === 8) {
    codes.forEach((c, i) => (out[head + i] = c & 0xff));
  } else {
    codes.forEach((c, i) => (out[head + (i >> 1)] |= c << (4 * (i & 1))));
  }
  return out;
}

function decodeValues(codec: Codec, raw: Uint8Array, n: number): Float32Array {
  if (raw.length !== rawSize(codec, n)) {
    throw new CodecError(`${codec.canonical}: ${raw.length} bytes, expected ${rawSize(codec, n)}`);
  }
  const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
  const out = new Float32Array(n);
  const v = codec.values;
  if (v.kind === "fp32") {
    for (let i = 0; i < n; i++) {
      out[i] = view.getFloat32(4 * i, true);
      if (!Number.isFinite(out[i])) throw new CodecError("fp32 payload contains NaN or Inf");
    }
    return out;
  }
  const { half, offset, top } = GRID[v.bits];
  const nb = nBlocks(n, v.block);
  const limit = Math.fround(FLT_MAX / half);
  for (let b = 0; b < nb; b++) {
    const step = view.getFloat32(4 * b, true);
    if (!(step >= 0 && step <= limit)) throw new CodecError(`${codec.canonical}: a block step is negative, too large or not finite`);
    const end = Math.min(n, (b + 1) * v.block);
    for (let i = b * v.block; i < end; i++) {
      let code: number;
      if (v.bits === 8) {
        code = view.getInt8(4 * nb + i);
        if (code < -top) throw new CodecError(`${codec.canonical}: code -128 is outside the grid`);
      } else {
        code = (raw[4 * nb + (i >> 1)] >> (4 * (i & 1))) & 0x0f;
        if (code > top) throw new CodecError(`${codec.canonical}: a code exceeds ${top}`);
      }
      out[i] = Math.fround((code - offset) * step);
    }
  }
  return out;
}

// -- zstd stage -------------------------------------------------------------------------------

/** `data` as a zstd frame of raw blocks declaring its content size (§5.4). */
export function storedZstd(data: Uint8Array): Uint8Array {
  const blocks = Math.max(1, Math.ceil(data.length / RAW_BLOCK_MAX));
  const out = new Uint8Array(13 + 3 * blocks + data.length);
  const view = new DataView(out.buffer);
  view.setUint32(0, ZSTD_MAGIC, true);
  out[4] = 0xe0;
  view.setBigUint64(5, BigInt(data.length), true);
  let at = 13;
  for (let start = 0, k = 0; k < blocks; k++, start += RAW_BLOCK_MAX) {
    const size = Math.min(RAW_BLOCK_MAX, data.length - start);
    const header = (size << 3) | (k === blocks - 1 ? 1 : 0);
    out.set([header & 0xff, (header >> 8) & 0xff, (header >> 16) & 0xff], at);
    out.set(data.subarray(start, start + size), at + 3);
    at += 3 + size;
  }
  return out;
}

/** The content size a zstd frame header declares, or null when it declares none. */
function declaredSize(frame: Uint8Array): number | null {
  if (frame.length < 5) throw new CodecError("zstd frame is truncated");
  const view = new DataView(frame.buffer, frame.byteOffset, frame.byteLength);
  if (view.getUint32(0, true) !== ZSTD_MAGIC) throw new CodecError("not a zstd frame");
  const fhd = frame[4];
  const single = (fhd >> 5) & 1;
  const fcsFlag = fhd >> 6;
  const fcsBytes = [single ? 1 : 0, 2, 4, 8][fcsFlag];
  const at = 5 + (single ? 0 : 1) + [0, 1, 2, 4][fhd & 3];
  if (fcsBytes === 0) return null;
  if (frame.length < at + fcsBytes) throw new CodecError("zstd frame header is truncated");
  if (fcsBytes === 1) return frame[at];
  if (fcsBytes === 2) return view.getUint16(at, true) + 256;
  if (fcsBytes === 4) return view.getUint32(at, true);
  return Number(view.getBigUint64(at, true));
}

function unzstd(frame: Uint8Array, expected: number): Uint8Array {
  const declared = declaredSize(frame);
  if (declared !== expected) throw new CodecError(`zstd frame declares ${declared} bytes, expected ${expected}`);
  let out: Uint8Array;
  try {
    out = decompress(frame, new Uint8Array(expected));
  } catch (err) {
    throw new CodecError(`zstd frame is corrupt: ${(err as Error).message}`);
  }
  if (out.length !== expected) throw new CodecError(`zstd frame holds ${out.length} bytes, expected ${expected}`);
  return out;
}

// -- nibble split of q8 codes (§5.4) ------------------------------------------------------------

export function splitNibbles(codes: Uint8Array): { hi: Uint8Array; lo: Uint8Array } {
  const h = Math.ceil(codes.length / 2);
  const hi = new Uint8Array(h);
  const lo = new Uint8Array(h);
  for (let i = 0; i < codes.length; i++) {
    const shift = 4 * (i & 1);
    hi[i >> 1] |= (codes[i] >> 4) << shift;
    lo[i >> 1] |= (codes[i] & 0x0f) << shift;
  }
  return { hi, lo };
}

export function joinNibbles(hi: Uint8Array, lo: Uint8Array, n: number): Uint8Array {
  const codes = new Uint8Array(n);
  for (let i = 0; i < n; i++) {
    const shift = 4 * (i & 1);
    codes[i] = (((hi[i >> 1] >> shift) & 0x0f) << 4) | ((lo[i >> 1] >> shift) & 0x0f);
  }
  return codes;
}

// -- frames -----------------------------------------------------------------------------------

function splitsNibbles(codec: Codec): boolean {
  return codec.zstdLevel !== null && codec.values.kind === "q" && codec.values.bits === 8;
}

export async function encodeFrame(codec: Codec, x: Float32Array): Promise<Uint8Array> {
  const raw = encodeValues(codec, x);
  let body = raw;
  if (splitsNibbles(codec)) {
    const head = raw.length - x.length;
    const { hi, lo } = splitNibbles(raw.subarray(head));
    body = Buffer.concat([raw.subarray(0, head), lo, storedZstd(hi)]);
  } else if (codec.zstdLevel !== null) {
    body = storedZstd(raw);
  }
  const out = new Uint8Array(HEADER_SIZE + body.length);
  const view = new DataView(out.buffer);
  out.set(MAGIC, 0);
  out[2] = VERSION;
  out[3] = 0;
  view.setUint32(4, codec.tag, true);
  view.setUint32(8, x.length, true);
  view.setUint32(12, await checksum(body), true);
  out.set(body, HEADER_SIZE);
  return out;
}

export async function decodeFrame(codec: Codec, data: Uint8Array, n: number): Promise<Float32Array> {
  if (data.length < HEADER_SIZE) throw new CodecError(`frame is truncated: ${data.length} bytes`);
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  if (data[0] !== MAGIC[0] || data[1] !== MAGIC[1]) throw new CodecError("not a geodiloco codec frame");
  if (data[2] !== VERSION) throw new CodecError(`frame format version ${data[2]} is not supported`);
  if (data[3] !== 0) throw new CodecError(`frame sets flags ${data[3]}`);
  if (view.getUint32(4, true) !== codec.tag) throw new CodecError(`frame was encoded by another codec than ${codec.spec}`);
  if (view.getUint32(8, true) !== n) throw new CodecError(`frame holds ${view.getUint32(8, true)} elements, expected ${n}`);
  const body = data.subarray(HEADER_SIZE);
  if ((await checksum(body)) !== view.getUint32(12, true)) throw new CodecError("frame checksum mismatch");
  const size = rawSize(codec, n);
  let raw: Uint8Array;
  if (splitsNibbles(codec)) {
    const head = size - n;
    const h = Math.ceil(n / 2);
    if (body.length < head + h) throw new CodecError("frame body is shorter than its stored part");
    const hi = unzstd(body.subarray(head + h), h);
    raw = Buffer.concat([body.subarray(0, head), joinNibbles(hi, body.subarray(head, head + h), n)]);
  } else if (codec.zstdLevel !== null) {
    raw = unzstd(body, size);
  } else {
    raw = body;
  }
  return decodeValues(codec, raw, n);
}
