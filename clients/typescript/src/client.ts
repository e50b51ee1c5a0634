// The OuterSync calls (docs/protocol.md §3-§4), over @grpc/grpc-js with the .proto loaded at run time.
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { fileURLToPath } from "node:url";
import { deltaAad, joinProof, open, seal, updateAad, type SiteKeys } from "./sealing.ts";

const PROTO = fileURLToPath(new URL("../../../protos/geodiloco/v1/outer_sync.proto", import.meta.url));
const MAX_MESSAGE_BYTES = 32 * 1024 * 1024;
const UNARY_TIMEOUT_MS = 30_000;

export interface DataRange {
  shard: number;
  start: number;
  end: number;
  epoch: number;
}

export interface ChunkHeader {
  run_id: string;
  round: number;
  fragment: number;
  site: string;
  codec: string;
  seq: number;
  start: number;
  numel: number;
  nonce: Buffer;
  key_id: number;
  rows: number;
  stride: number;
}

export interface JoinResponse {
  run_id: string;
  run_config_json: string;
  round: number;
  state_hash: string;
  shard_index: number;
  shard_count: number;
  num_params: number;
  heartbeat_interval_s: number;
  finished: boolean;
  key_id: number;
  data: DataRange[];
}

export interface UpdateChunk {
  header: ChunkHeader;
  payload: Buffer;
  next_round: number;
  state_hash: string;
  total_chunks: number;
  finished: boolean;
  kind: "UPDATE" | "FULL_STATE";
  data: DataRange[];
}

/** One pulled stream: its facts and its chunks' (opened, still encoded) frames. */
export interface Pulled {
  kind: "UPDATE" | "FULL_STATE";
  codec: string;
  round: number;
  nextRound: number;
  stateHash: string;
  finished: boolean;
  data: DataRange[];
  chunks: { start: number; numel: number; frame: Buffer }[];
}

export interface Tls {
  ca: Buffer;
  key: Buffer;
  cert: Buffer;
}

/** A gRPC failure with its status code name, e.g. "FAILED_PRECONDITION". */
export class RpcError extends Error {
  constructor(
    readonly code: string,
    readonly details: string,
  ) {
    super(`${code}: ${details}`);
  }
}

function rpcError(err: grpc.ServiceError): RpcError {
  return new RpcError(grpc.status[err.code] ?? String(err.code), err.details);
}

function deadline(ms: number): Date {
  return new Date(Date.now() + ms);
}

type Stub = grpc.Client & Record<string, (...args: unknown[]) => unknown>;

function loadStub(target: string, tls: Tls | null): Stub {
  const definition = protoLoader.loadSync(PROTO, { keepCase: true, longs: Number, enums: String, defaults: true, bytes: Buffer });
  const pkg = grpc.loadPackageDefinition(definition) as unknown as {
    geodiloco: { v1: { OuterSync: new (target: string, creds: grpc.ChannelCredentials, options: object) => Stub } };
  };
  const creds = tls ? grpc.credentials.createSsl(tls.ca, tls.key, tls.cert) : grpc.credentials.createInsecure();
  return new pkg.geodiloco.v1.OuterSync(target, creds, {
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
  });
}

export class OuterSyncClient {
  private readonly stub: Stub;
  runId = "";
  keys: SiteKeys | null = null;

  constructor(
    target: string,
    readonly site: string,
    tls: Tls | null,
  ) {
    this.stub = loadStub(target, tls);
  }

  close(): void {
    this.stub.close();
  }

  private unary<T>(method: string, request: object, timeoutMs = UNARY_TIMEOUT_MS): Promise<T> {
    return new Promise((resolve, reject) => {
      this.stub[method](request, { deadline: deadline(timeoutMs) }, (err: grpc.ServiceError | null, reply: T) =>
        err ? reject(rpcError(err)) : resolve(reply),
      );
    });
  }

  /** Join; with the site secret, the request carries its key proof (protocol.md §6.2). */
  async join(worldSize = 1, secret: Uint8Array | null = null): Promise<JoinResponse> {
    const keyProof = secret ? joinProof(secret, this.runId, this.site, worldSize) : Buffer.alloc(0);
    const request = { run_id: this.runId, site: this.site, world_size: worldSize, version: "", key_proof: keyProof };  // protocol.md §3: a foreign site sends no version
    const reply = await this.unary<JoinResponse>("Join", request);
    this.runId = reply.run_id;
    return reply;
  }

  heartbeat(round: number): Promise<{ round: number; lease_s: number; finished: boolean }> {
    return this.unary("Heartbeat", { run_id: this.runId, site: this.site, round });
  }

  report(round: number, stateHash: string, tokens: number, trainLoss: number, computeSeconds: number): Promise<{ hash_ok: boolean; expected_hash: string }> {
    return this.unary("Report", {
      run_id: this.runId,
      site: this.site,
      round,
      state_hash: stateHash,
      train_loss: trainLoss,
      tokens,
      compute_seconds: computeSeconds,
    });
  }

  leave(reason: string): Promise<object> {
    return this.unary("Leave", { run_id: this.runId, site: this.site, reason });
  }

  /** One part (the whole contribution) of round `round`: frames in canonical order. */
  push(
    round: number,
    codec: string,
    frames: { start: number; numel: number; frame: Uint8Array }[],
    tokens: number,
    data: DataRange[],
    timeoutMs: number,
  ): Promise<{ round: number; duplicate: boolean; payload_bytes: number }> {
    const messages = frames.map((f, seq) => {
      const header = {
        run_id: this.runId,
        round,
        fragment: 0,
        site: this.site,
        codec,
        seq,
        start: f.start,
        numel: f.numel,
        nonce: Buffer.alloc(0) as Buffer,
        key_id: 0,
        rows: 0,
        stride: 0,
      };
      const msg = { header, payload: Buffer.from(f.frame) as Buffer, tokens, total_chunks: frames.length, data: seq === 0 ? data : [], part: 0, parts: 1 };
      if (this.keys) {
        header.key_id = this.keys.keyId;
        const sealed = seal(this.keys.up, f.frame, deltaAad(msg));
        header.nonce = sealed.nonce;
        msg.payload = sealed.sealed;
      }
      return msg;
    });
    return new Promise((resolve, reject) => {
      const call = this.stub.PushDelta({ deadline: deadline(timeoutMs) }, (err: grpc.ServiceError | null, ack: { round: number; duplicate: boolean; payload_bytes: number }) =>
        err ? reject(rpcError(err)) : resolve(ack),
      ) as grpc.ClientWritableStream<object>;
      for (const m of messages) call.write(m);
      call.end();
    });
  }

  /** The update closing `round` (waits for its commit), or the full state. */
  async pull(round: number, fullState: boolean, timeoutMs: number): Promise<Pulled> {
    const call = this.stub.PullUpdate(
      { run_id: this.runId, site: this.site, round, kind: fullState ? "FULL_STATE" : "UPDATE", part: 0, parts: 1 },
      { deadline: deadline(timeoutMs) },
    ) as grpc.ClientReadableStream<UpdateChunk>;
    const chunks: Pulled["chunks"] = [];
    let last: UpdateChunk | null = null;
    try {
      for await (const msg of call as AsyncIterable<UpdateChunk>) {
        if (last && (msg.header.codec !== last.header.codec || msg.state_hash !== last.state_hash || msg.kind !== last.kind)) {
          throw new Error("an update stream changed its codec, hash or kind midway");
        }
        last = msg;
        if (msg.header.numel === 0) continue;
        const frame = this.keys ? open(this.keys.down, msg.header.nonce, msg.payload, updateAad(msg)) : msg.payload;
        chunks.push({ start: msg.header.start, numel: msg.header.numel, frame });
      }
    } catch (err) {
      if ((err as grpc.ServiceError).code !== undefined && (err as grpc.ServiceError).details !== undefined) throw rpcError(err as grpc.ServiceError);
      throw err;
    }
    if (!last) throw new Error("the coordinator sent an empty stream");
    if (chunks.length !== last.total_chunks) throw new Error(`received ${chunks.length} of ${last.total_chunks} chunks`);
    return {
      kind: last.kind,
      codec: last.header.codec,
      round: last.header.round,
      nextRound: last.next_round,
      stateHash: last.state_hash,
      finished: last.finished,
      data: last.data,
      chunks,
    };
  }
}
