// Payload sealing of docs/protocol.md §6: HKDF-SHA256 keys, AES-256-GCM, the AAD bytes.
import { createCipheriv, createDecipheriv, createHmac, hkdfSync, randomBytes } from "node:crypto";

const SALT = Buffer.from("geodiloco/v1", "ascii");
const AAD_MAGIC = Buffer.from("geodiloco-chunk-v2\0", "ascii");
const NONCE_BYTES = 12;
const TAG_BYTES = 16;

export class SealError extends Error {}

export type Int = number | bigint | string; // u64 fields may come as strings (JSON) or numbers

export interface HeaderFields {
  run_id: string;
  round: Int;
  fragment: Int;
  site: string;
  codec: string;
  seq: Int;
  start: Int;
  numel: Int;
  key_id: Int;
  rows: Int;
  stride: Int;
}

export interface RangeFields {
  shard: Int;
  start: Int;
  end: Int;
  epoch: Int;
}

export function hkdf(secret: Uint8Array, info: string | Uint8Array, length = 32): Buffer {
  return Buffer.from(hkdfSync("sha256", secret, SALT, typeof info === "string" ? Buffer.from(info, "utf8") : info, length));
}

export function keyId(siteSecret: Uint8Array, runId: string): number {
  const id = hkdf(siteSecret, `key-id\0${runId}`, 4).readUInt32BE(0);
  return id === 0 ? 1 : id;
}

export interface SiteKeys {
  keyId: number;
  up: Buffer; // seals pushes
  down: Buffer; // opens updates and full state
}

export function deriveKeys(siteSecret: Uint8Array, runId: string): SiteKeys {
  return {
    keyId: keyId(siteSecret, runId),
    up: hkdf(siteSecret, `chunk\0${runId}\0up`),
    down: hkdf(siteSecret, `chunk\0${runId}\0down`),
  };
}

class Writer {
  parts: Buffer[] = [];
  u8(v: Int) {
    this.parts.push(Buffer.from([Number(v)]));
  }
  u16(v: Int) {
    const b = Buffer.alloc(2);
    b.writeUInt16BE(Number(v));
    this.parts.push(b);
  }
  u32(v: Int) {
    const b = Buffer.alloc(4);
    b.writeUInt32BE(Number(v));
    this.parts.push(b);
  }
  u64(v: Int) {
    const b = Buffer.alloc(8);
    b.writeBigUInt64BE(BigInt(v));
    this.parts.push(b);
  }
  str(s: string) {
    const b = Buffer.from(s, "utf8");
    this.u16(b.length);
    this.parts.push(b);
  }
  bytes(b: Buffer) {
    this.parts.push(b);
  }
  ranges(data: RangeFields[]) {
    for (const d of data) {
      this.u32(d.shard);
      this.u64(d.start);
      this.u64(d.end);
      this.u32(d.epoch);
    }
  }
  done(): Buffer {
    return Buffer.concat(this.parts);
  }
}

/** The proof of §6.2 that this site holds its secret: HMAC-SHA256 over the Join's fields. */
export function joinProof(siteSecret: Uint8Array, runId: string, site: string, worldSize: number): Buffer {
  const w = new Writer();
  w.bytes(Buffer.from("geodiloco-join-v1\0", "ascii"));
  w.str(runId);
  w.str(site);
  w.u32(worldSize);
  return createHmac("sha256", hkdf(siteSecret, "join-proof")).update(w.done()).digest();
}

function aad(direction: string, kind: string, h: HeaderFields, extra: Buffer): Buffer {
  const w = new Writer();
  w.bytes(AAD_MAGIC);
  for (const s of [direction, h.run_id, h.site, h.codec, kind]) w.str(s);
  w.u64(h.round);
  w.u32(h.fragment);
  w.u64(h.seq);
  w.u64(h.start);
  w.u64(h.numel);
  w.u32(h.key_id);
  w.u32(h.rows);
  w.u64(h.stride);
  w.u16(extra.length);
  w.bytes(extra);
  return w.done();
}

export interface DeltaFields {
  header: HeaderFields;
  tokens: Int;
  total_chunks: Int;
  part: Int;
  parts: Int;
  data: RangeFields[];
}

export function deltaAad(m: DeltaFields): Buffer {
  const w = new Writer();
  w.u64(m.tokens);
  w.u32(m.total_chunks);
  w.u32(m.part);
  w.u32(m.parts);
  w.u32(m.data.length);
  w.ranges(m.data);
  return aad("up", "delta", m.header, w.done());
}

export interface UpdateFields {
  header: HeaderFields;
  next_round: Int;
  total_chunks: Int;
  finished: boolean;
  data: RangeFields[];
  state_hash: string;
  kind: string | number; // UPDATE (1) or FULL_STATE (2)
}

export function updateKind(kind: string | number): string {
  if (kind === 1 || kind === "UPDATE") return "update";
  if (kind === 2 || kind === "FULL_STATE") return "full_state";
  return `kind-${kind}`;
}

export function updateAad(m: UpdateFields): Buffer {
  const w = new Writer();
  w.u64(m.next_round);
  w.u32(m.total_chunks);
  w.u8(m.finished ? 1 : 0);
  w.u32(m.data.length);
  w.bytes(Buffer.from(m.state_hash, "ascii"));
  w.ranges(m.data);
  return aad("down", updateKind(m.kind), m.header, w.done());
}

/** AES-256-GCM: ciphertext ‖ tag. */
export function seal(key: Buffer, plaintext: Uint8Array, aadBytes: Buffer, nonce: Buffer = randomBytes(NONCE_BYTES)): { nonce: Buffer; sealed: Buffer } {
  const cipher = createCipheriv("aes-256-gcm", key, nonce);
  cipher.setAAD(aadBytes);
  const sealed = Buffer.concat([cipher.update(plaintext), cipher.final(), cipher.getAuthTag()]);
  return { nonce, sealed };
}

export function open(key: Buffer, nonce: Uint8Array, sealed: Uint8Array, aadBytes: Buffer): Buffer {
  if (nonce.length !== NONCE_BYTES) throw new SealError(`nonce must be ${NONCE_BYTES} bytes, got ${nonce.length}`);
  if (sealed.length < TAG_BYTES) throw new SealError("sealed payload is shorter than its tag");
  const decipher = createDecipheriv("aes-256-gcm", key, nonce);
  decipher.setAAD(aadBytes);
  decipher.setAuthTag(sealed.subarray(sealed.length - TAG_BYTES));
  try {
    return Buffer.concat([decipher.update(sealed.subarray(0, sealed.length - TAG_BYTES)), decipher.final()]);
  } catch {
    throw new SealError("authentication tag mismatch: altered, moved, or sealed with another key");
  }
}
