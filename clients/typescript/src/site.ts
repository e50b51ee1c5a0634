// A runnable geodiloco site (docs/protocol.md §3): join, fetch θ, then every round train the
// site's own model, push a sealed pseudo-gradient, pull and apply the update, report the hash;
// leave at the end. Prints one JSON line per round on stdout.
//
//   tsx src/site.ts --coordinator HOST:PORT --name SITE --tls-cert C --tls-key K --tls-ca CA --secret S
//   tsx src/site.ts --coordinator 127.0.0.1:PORT --name SITE --insecure
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { checkCertificate } from "./certcheck.ts";
import { OuterSyncClient, RpcError, type DataRange, type JoinResponse, type Pulled, type Tls } from "./client.ts";
import { decodeFrame, encodeFrame, parseCodec, UnsupportedCodec, type Codec } from "./codec.ts";
import { stateHash } from "./hash.ts";
import { train, windowsOf } from "./model.ts";
import { deriveKeys } from "./sealing.ts";

const FULL_STATE_CODEC = "fp32|zstd:1";
const MAX_EXCHANGES = 8;

class SiteError extends Error {}

interface RunConfig {
  rounds: number;
  round_timeout_s: number;
  inner: { steps_per_round: number };
  data: { batch_size: number };
  compression: { uplink: string; downlink: string; chunk_elements: number };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function say(line: object): void {
  process.stdout.write(JSON.stringify(line) + "\n");
}

class Site {
  theta: Float32Array = new Float32Array(0);
  round = 0;
  data: DataRange[] = [];
  finished = false;
  numParams = 0;
  residual: Float32Array = new Float32Array(0);
  cfg!: RunConfig;
  uplink!: Codec;
  private heartbeat: NodeJS.Timeout | null = null;

  constructor(
    readonly client: OuterSyncClient,
    readonly secret: Buffer | null,
    readonly lr: number,
  ) {}

  get pullTimeoutMs(): number {
    return (this.cfg.round_timeout_s + 300) * 1000;
  }

  /** Join (waiting for a coordinator that is not up yet), check codecs and keys. */
  async join(): Promise<JoinResponse> {
    let delay = 200;
    for (let attempt = 1; ; attempt++) {
      try {
        const info = await this.client.join(1, this.secret);
        this.adopt(info);
        return info;
      } catch (err) {
        if (!(err instanceof RpcError) || err.code !== "UNAVAILABLE" || attempt >= 10) throw err;
        await sleep(delay);
        delay = Math.min(delay * 2, 5000);
      }
    }
  }

  private adopt(info: JoinResponse): void {
    this.cfg = JSON.parse(info.run_config_json) as RunConfig;
    this.round = info.round;
    this.data = info.data;
    this.finished = info.finished;
    if (this.numParams !== info.num_params) this.residual = new Float32Array(info.num_params);
    this.numParams = info.num_params;
    if (info.key_id === 0 && this.secret) throw new SiteError("the coordinator does not seal payloads; refusing to send them in the clear");
    if (info.key_id !== 0) {
      if (!this.secret) throw new SiteError("the coordinator seals payloads; give this site its secret (--secret)");
      const keys = deriveKeys(this.secret, info.run_id);
      if (keys.keyId !== info.key_id) {
        throw new SiteError(`this site's secret gives key id ${keys.keyId.toString(16)}, the run expects ${info.key_id.toString(16)}`);
      }
      this.client.keys = keys;
    }
  }

  /** §9: every site supports the run's codecs, or leaves saying which one it lacks. */
  async checkCodecs(): Promise<void> {
    try {
      this.uplink = parseCodec(this.cfg.compression.uplink);
      parseCodec(this.cfg.compression.downlink);
      parseCodec(FULL_STATE_CODEC);
    } catch (err) {
      if (!(err instanceof UnsupportedCodec)) throw err;
      await this.client.leave(`unsupported codec: ${err.message}`);
      throw new SiteError(`unsupported codec: ${err.message}`);
    }
  }

  startHeartbeat(intervalS: number): void {
    this.heartbeat = setInterval(() => {
      this.client.heartbeat(this.round).catch(async (err: unknown) => {
        if (err instanceof RpcError && err.code === "FAILED_PRECONDITION") await this.client.join(1, this.secret).catch(() => undefined);
      });
    }, intervalS * 1000);
  }

  stopHeartbeat(): void {
    if (this.heartbeat) clearInterval(this.heartbeat);
  }

  async decode(pulled: Pulled): Promise<Float32Array> {
    const expected = pulled.kind === "FULL_STATE" ? FULL_STATE_CODEC : this.cfg.compression.downlink;
    if (pulled.codec !== expected) throw new SiteError(`the stream's codec ${pulled.codec} is not the run's ${expected}`);
    const codec = parseCodec(pulled.codec);
    const out = new Float32Array(this.numParams);
    let at = 0;
    for (const c of pulled.chunks) {
      if (c.start !== at) throw new SiteError(`chunk starts at ${c.start}, expected ${at}`);
      out.set(await decodeFrame(codec, c.frame, c.numel), c.start);
      at += c.numel;
    }
    if (at !== out.length) throw new SiteError(`chunks cover ${at} of ${out.length} elements`);
    return out;
  }

  /** θ ← state, or θ ← snapshot + update (f32 additions); then the hash must match. */
  async apply(pulled: Pulled, snapshot: Float32Array): Promise<string> {
    const values = await this.decode(pulled);
    if (pulled.kind === "FULL_STATE") this.theta = values;
    else this.theta = snapshot.map((v, i) => v + values[i]);
    const digest = stateHash(this.theta);
    if (digest !== pulled.stateHash) throw new SiteError(`hash after round ${pulled.round} is ${digest}, the coordinator's ${pulled.stateHash}`);
    this.round = pulled.nextRound;
    this.finished = pulled.finished;
    this.data = pulled.data;
    return digest;
  }

  fullState(): Promise<Pulled> {
    return this.client.pull(0, true, this.pullTimeoutMs);
  }

  async encodeDelta(snapshot: Float32Array): Promise<{ start: number; numel: number; frame: Uint8Array }[]> {
    const n = snapshot.length;
    const toSend = new Float32Array(n);
    for (let i = 0; i < n; i++) toSend[i] = snapshot[i] - this.theta[i] + this.residual[i];
    const frames = [];
    const size = this.cfg.compression.chunk_elements;
    for (let start = 0; start < n; start += size) {
      const part = toSend.subarray(start, Math.min(n, start + size));
      const frame = await encodeFrame(this.uplink, part);
      const back = await decodeFrame(this.uplink, frame, part.length);
      for (let i = 0; i < part.length; i++) this.residual[start + i] = part[i] - back[i]; // error feedback
      frames.push({ start, numel: part.length, frame });
    }
    return frames;
  }

  /** Push (idempotent) and pull round r's update, following §3.1 on every refusal. */
  async exchange(r: number, frames: { start: number; numel: number; frame: Uint8Array }[], tokens: number): Promise<Pulled> {
    let resync = false;
    let held = false; // the coordinator holds a push of this site for round r: pull only
    for (let attempt = 0; attempt < MAX_EXCHANGES; attempt++) {
      try {
        if (resync) {
          this.adopt(await this.client.join(1, this.secret));
          return await this.fullState();
        }
        if (!held) {
          const ack = await this.client.push(r, this.uplink.spec, frames, tokens, this.data, this.pullTimeoutMs);
          say({ event: "pushed", round: r, duplicate: ack.duplicate, payload_bytes: Number(ack.payload_bytes) });
          held = true;
        }
        return await this.client.pull(r, false, this.pullTimeoutMs);
      } catch (err) {
        if (!(err instanceof RpcError)) throw err;
        say({ event: "refused", round: r, code: err.code, details: err.details });
        if (err.code === "FAILED_PRECONDITION") resync = true;
        else if (err.code === "ALREADY_EXISTS") held = true; // another push of ours counts: give this one up
        else if (err.code === "ABORTED") held = false; // our contribution was lost: push again
        else if (err.code === "UNAVAILABLE" || err.code === "DEADLINE_EXCEEDED") await sleep(500 * (attempt + 1));
        else throw err;
      }
    }
    throw new SiteError(`round ${r}: no update after ${MAX_EXCHANGES} attempts`);
  }

  async run(): Promise<void> {
    const info = await this.join();
    await this.checkCodecs();
    this.startHeartbeat(info.heartbeat_interval_s);
    try {
      const state = await this.fullState();
      await this.apply(state, this.theta);
      say({ event: "joined", round: this.round, num_params: this.theta.length, codec: this.uplink.spec, sealed: info.key_id !== 0 });
      while (!this.finished) {
        const r = this.round;
        const snapshot = this.theta.slice();
        const started = performance.now();
        const windows = windowsOf(this.data);
        const loss = train(this.theta, windows, this.cfg.inner.steps_per_round, this.cfg.data.batch_size, this.lr);
        const seconds = (performance.now() - started) / 1000;
        const pulled = await this.exchange(r, await this.encodeDelta(snapshot), Math.max(1, windows.length));
        const digest = await this.apply(pulled, snapshot);
        // the round whose commit produced θ: the update's, or the one before a full state's
        const closed = pulled.nextRound - 1;
        const reply = closed >= 0 ? await this.client.report(closed, digest, windows.length, loss, seconds) : null;
        say({ event: "round", round: closed, kind: pulled.kind, hash: digest, hash_ok: reply?.hash_ok ?? null, train_loss: loss });
        if (!this.finished && this.data.length === 0) this.adopt(await this.client.join(1, this.secret)); // lease lapsed: no data
      }
      await this.client.leave("finished");
      say({ event: "left", round: this.round });
    } finally {
      this.stopHeartbeat();
    }
  }
}

async function main(): Promise<number> {
  const { values } = parseArgs({
    options: {
      coordinator: { type: "string", default: "127.0.0.1:50051" },
      name: { type: "string" },
      "tls-cert": { type: "string" },
      "tls-key": { type: "string" },
      "tls-ca": { type: "string" },
      secret: { type: "string" },
      insecure: { type: "boolean", default: false },
      lr: { type: "string", default: "0.05" },
    },
  });
  if (!values.name) throw new SiteError("--name is required");
  let tls: Tls | null = null;
  if (!values.insecure) {
    if (!values["tls-cert"] || !values["tls-key"] || !values["tls-ca"]) throw new SiteError("--tls-cert, --tls-key and --tls-ca are required (or --insecure on loopback)");
    tls = { cert: readFileSync(values["tls-cert"]), key: readFileSync(values["tls-key"]), ca: readFileSync(values["tls-ca"]) };
    const problem = checkCertificate(tls.cert, tls.ca, values.name);
    if (problem) throw new SiteError(problem);
  }
  const secret = values.secret ? readFileSync(values.secret) : null;
  if (secret && secret.length !== 32) throw new SiteError(`secret file ${values.secret}: expected 32 bytes, found ${secret.length}`);
  const client = new OuterSyncClient(values.coordinator!, values.name, tls);
  try {
    await new Site(client, secret, Number(values.lr)).run();
  } finally {
    client.close();
  }
  return 0;
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    const known = err instanceof SiteError || err instanceof RpcError || err instanceof UnsupportedCodec;
    process.stderr.write(`geodiloco-site-ts: ${known ? (err as Error).message : (err as Error).stack}\n`);
    process.exit(known ? 2 : 1);
  },
);
