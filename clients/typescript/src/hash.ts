// The state hash of docs/protocol.md §8.
import { createHash } from "node:crypto";

const M64 = (1n << 64n) - 1n;
const GOLDEN = 0x9e3779b97f4a7c15n;
const MIX1 = 0xbf58476d1ce4e5b9n;
const MIX2 = 0x94d049bb133111ebn;

export function stateHash(theta: Float32Array): string {
  const bits = new Uint32Array(theta.buffer, theta.byteOffset, theta.length);
  let low = 0n;
  let high = 0n;
  for (let i = 0; i < theta.length; i++) {
    let x = (BigInt(i) * GOLDEN + BigInt(bits[i])) & M64;
    x ^= x >> 30n;
    x = (x * MIX1) & M64;
    x ^= x >> 27n;
    x = (x * MIX2) & M64;
    x ^= x >> 31n;
    low += x & 0xffffffffn;
    high += x >> 32n;
  }
  return createHash("sha256").update(`${low}:${high}:${theta.length}`, "ascii").digest("hex");
}
