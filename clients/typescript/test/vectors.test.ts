// The conformance vectors of docs/protocol.md §11, read from tests/protocol/vectors/.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { CodecError, decodeFrame, encodeFrame, parseCodec, splitNibbles, joinNibbles } from "../src/codec.ts";
import { deltaAad, deriveKeys, hkdf, joinProof, keyId, open, seal, updateAad } from "../src/sealing.ts";
import { stateHash } from "../src/hash.ts";

const VECTORS = fileURLToPath(new URL("../../../tests/protocol/vectors/", import.meta.url));
const load = (name: string) => JSON.parse(readFileSync(`${VECTORS}${name}.json`, "utf8"));
const hex = (h: string) => Buffer.from(h, "hex");
const f32 = (h: string) => {
  const b = hex(h);
  return new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.length));
};
const f32hex = (x: Float32Array) => Buffer.from(x.buffer, x.byteOffset, x.byteLength).toString("hex");

const frames = load("frames");

test("spec strings: canonical form and tag", () => {
  for (const s of frames.specs) {
    const codec = parseCodec(s.spec);
    assert.equal(codec.canonical, s.canonical, s.spec);
    assert.equal(codec.tag, s.tag, s.spec);
  }
});

for (const c of frames.frames) {
  test(`frame ${c.name}: decodes to the given values`, async () => {
    const codec = parseCodec(c.spec);
    assert.equal(codec.canonical, c.canonical);
    assert.equal(codec.tag, c.tag);
    const values = await decodeFrame(codec, hex(c.frame), c.numel);
    assert.equal(f32hex(values), c.decoded_f32le);
  });
  test(`frame ${c.name}: encodes to the given bytes, or to bytes that decode the same`, async () => {
    const codec = parseCodec(c.spec);
    const frame = await encodeFrame(codec, f32(c.input_f32le));
    if (c.encode_exact) assert.equal(Buffer.from(frame).toString("hex"), c.frame);
    assert.equal(f32hex(await decodeFrame(codec, frame, c.numel)), c.decoded_f32le);
  });
  test(`frame ${c.name}: a flipped byte is refused`, async () => {
    const frame = hex(c.frame);
    frame[frame.length - 1] ^= 1;
    await assert.rejects(decodeFrame(parseCodec(c.spec), frame, c.numel), CodecError);
  });
}

test("nibble split and join are inverse, odd lengths included", () => {
  const codes = Uint8Array.from([0x12, 0xab, 0xff, 0x00, 0x7f]);
  const { hi, lo } = splitNibbles(codes);
  assert.deepEqual([...hi], [0xa1, 0x0f, 0x07]);
  assert.deepEqual([...lo], [0xb2, 0x0f, 0x0f]);
  assert.deepEqual(joinNibbles(hi, lo, 5), codes);
});

test("codecs outside the core set are named as unsupported", () => {
  assert.throws(() => parseCodec("topk:0.1|q2"), /outside this client's core set/);
  assert.throws(() => parseCodec("fp16"), /outside this client's core set/);
});

const sealing = load("sealing");

test("key derivation: site secret, key ids, chunk keys", () => {
  const secret = hkdf(hex(sealing.run_secret), Buffer.from(`site-secret\0${sealing.site}`));
  assert.equal(secret.toString("hex"), sealing.site_secret);
  const keys = deriveKeys(secret, sealing.run_id);
  assert.equal(keys.keyId, sealing.key_id);
  assert.equal(keys.up.toString("hex"), sealing.key_up);
  assert.equal(keys.down.toString("hex"), sealing.key_down);
  for (const k of sealing.key_ids) assert.equal(keyId(hex(k.site_secret), k.run_id), k.key_id);
});

test("join proofs (§6.2)", () => {
  for (const c of sealing.join_proofs) {
    assert.equal(joinProof(hex(sealing.site_secret), c.run_id, sealing.site, c.world_size).toString("hex"), c.proof);
  }
});

for (const c of sealing.cases) {
  test(`sealing ${c.name}: AAD bytes, sealed payload, and opening`, () => {
    const aad = c.message === "DeltaChunk" ? deltaAad(c.fields) : updateAad(c.fields);
    assert.equal(aad.toString("hex"), c.aad);
    const key = c.key === "up" ? hex(sealing.key_up) : hex(sealing.key_down);
    const { sealed } = seal(key, hex(c.plaintext), aad, hex(c.nonce));
    assert.equal(sealed.toString("hex"), c.sealed);
    assert.equal(open(key, hex(c.nonce), hex(c.sealed), aad).toString("hex"), c.plaintext);
    const moved = c.message === "DeltaChunk" ? deltaAad({ ...c.fields, tokens: "1" }) : updateAad({ ...c.fields, next_round: "9" });
    assert.throws(() => open(key, hex(c.nonce), hex(c.sealed), moved), /authentication tag mismatch/);
  });
}

test("state hashes", () => {
  for (const c of load("hash").cases) {
    const values = f32(c.values_f32le);
    assert.equal(values.length, c.numel);
    assert.equal(stateHash(values), c.hash, c.name);
  }
});
