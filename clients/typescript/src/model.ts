// The site's own tiny model (docs/protocol.md leaves training to the site): a linear predictor
// over the whole parameter vector, fitted by SGD to a synthetic teacher on sparse samples. Each
// window the ledger hands out (§7) names one sample, so the data is the same wherever it runs.

const FEATURES = 8; // parameters one sample touches

function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export interface Window {
  shard: number;
  window: number;
  epoch: number;
}

/** The windows of the assigned ranges, in order. */
export function windowsOf(data: { shard: number; start: number; end: number; epoch: number }[]): Window[] {
  const out: Window[] = [];
  for (const d of data) for (let w = d.start; w < d.end; w++) out.push({ shard: d.shard, window: w, epoch: d.epoch });
  return out;
}

function sample(w: Window, n: number): { idx: number[]; x: number[]; y: number } {
  const rand = mulberry32(w.shard * 1_000_003 + w.window * 7919 + w.epoch * 104_729 + 17);
  const idx: number[] = [];
  const x: number[] = [];
  let y = 0;
  for (let k = 0; k < FEATURES; k++) {
    const j = Math.floor(rand() * n);
    const v = 2 * rand() - 1;
    idx.push(j);
    x.push(v);
    y += v * 0.05 * Math.sin(j); // the teacher's weight at j
  }
  return { idx, x, y };
}

/** `steps` SGD steps of `batch` windows each on `theta`, in place; returns the mean loss. */
export function train(theta: Float32Array, windows: Window[], steps: number, batch: number, lr: number): number {
  let loss = 0;
  let seen = 0;
  for (let s = 0; s < steps; s++) {
    const grad = new Map<number, number>();
    for (const w of windows.slice(s * batch, (s + 1) * batch)) {
      const { idx, x, y } = sample(w, theta.length);
      const err = idx.reduce((acc, j, k) => acc + theta[j] * x[k], 0) - y;
      loss += 0.5 * err * err;
      seen += 1;
      idx.forEach((j, k) => grad.set(j, (grad.get(j) ?? 0) + (err * x[k]) / batch));
    }
    for (const [j, g] of grad) theta[j] -= lr * g;
  }
  return seen ? loss / seen : 0;
}
