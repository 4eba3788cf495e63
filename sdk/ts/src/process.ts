/** A process started by `Box.exec`: its output as it streams, its stdin, signals, its exit.
 * Browser-safe. */
import { SandboxerError, type JsonObject } from "./errors.js";
import type { EventStream } from "./events.js";
import { concatBytes, outputBytes, type Event } from "./protocol.js";

/** What a process handle needs from its box. */
export interface ProcessControl {
  stdin(proc: string, data: Uint8Array | string, opts: { eof?: boolean; branch?: string }): Promise<void>;
  signal(proc: string, signal: string | number, opts: { branch?: string }): Promise<void>;
  resize(proc: string, cols: number, rows: number, opts: { branch?: string }): Promise<void>;
}

/** Handle of one process of the box, by its client-chosen id `proc`.
 *
 * It follows the process's events (`proc.started`, `proc.output`, `proc.message`,
 * `proc.exited`) on an event stream of its own and keeps them, so `output()` can be iterated by
 * any number of readers from the start and `wait()` works whether or not anyone reads. */
export class Process {
  readonly branch: string | undefined;
  /** Every event of this process received so far, in seq order. */
  readonly events: Event[] = [];
  /** The `proc.exited` event once it arrived. */
  exit: Event | null = null;
  private error: unknown = null;
  private finished = false;
  private waiters: Array<() => void> = [];
  private readonly followed: Promise<void>;

  constructor(
    private readonly box: ProcessControl,
    readonly proc: string,
    /** The exec reply (`existing: true` with the state when the id already ran). */
    readonly reply: JsonObject,
    private readonly stream: EventStream,
  ) {
    this.branch = typeof reply.branch === "string" ? reply.branch : undefined;
    this.followed = this.follow();
  }

  private async follow(): Promise<void> {
    try {
      for await (const ev of this.stream) {
        this.events.push(ev);
        if (ev.type === "proc.exited") this.exit = ev;
        this.notify();
        if (this.exit) break;
      }
    } catch (e) {
      this.error = e; // raised by wait() and output() in the caller's context
    } finally {
      this.stream.close();
      this.finished = true;
      this.notify();
    }
  }

  private notify(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }

  private changed(): Promise<void> {
    return new Promise((r) => this.waiters.push(r));
  }

  get done(): boolean {
    return this.exit !== null;
  }

  /** The exit code; null while running or when a signal ended it. */
  get exitCode(): number | null {
    return typeof this.exit?.code === "number" ? this.exit.code : null;
  }

  /** The name of the signal that ended the process (e.g. "KILL"), or null. */
  get exitSignal(): string | null {
    return typeof this.exit?.signal === "string" ? this.exit.signal : null;
  }

  private collect(stream: string): Uint8Array {
    return concatBytes(this.events.filter((e) => e.type === "proc.output" && e.stream === stream).map(outputBytes));
  }

  /** All stdout bytes received so far. */
  get stdout(): Uint8Array {
    return this.collect("stdout");
  }

  /** All stderr bytes received so far. */
  get stderr(): Uint8Array {
    return this.collect("stderr");
  }

  /** All bytes of the pty (exec with tty) received so far. */
  get pty(): Uint8Array {
    return this.collect("pty");
  }

  /** The JSON objects the process printed as lines (`proc.message`). */
  get messages(): JsonObject[] {
    return this.events.filter((e) => e.type === "proc.message").map((e) => e.message as JsonObject);
  }

  private followError(): SandboxerError | unknown {
    return this.error ?? new SandboxerError("connection_closed", `event stream of ${this.proc} ended before proc.exited`);
  }

  /** Every event of this process, from the first, until `proc.exited` (included). */
  async *iterEvents(): AsyncGenerator<Event> {
    let i = 0;
    for (;;) {
      while (i < this.events.length) yield this.events[i++]!;
      if (this.exit) return;
      if (this.finished) throw this.followError();
      await this.changed();
    }
  }

  /** [stream, bytes] for each output chunk as it arrives, from the first, until exit. */
  async *output(): AsyncGenerator<[string, Uint8Array]> {
    for await (const ev of this.iterEvents()) {
      if (ev.type === "proc.output") yield [String(ev.stream), outputBytes(ev)];
    }
  }

  /** Resolves with `proc.exited` (`code` or `signal`, `reason`). Rejects with a SandboxerError
   * (code `timeout`) after `timeoutMs`, or when the stream ended first. */
  async wait(timeoutMs?: number): Promise<Event> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    const timeout = new Promise<never>((_, reject) => {
      if (timeoutMs !== undefined) {
        timer = setTimeout(() => reject(new SandboxerError("timeout", `${this.proc} did not exit within ${timeoutMs} ms`)), timeoutMs);
      }
    });
    try {
      await Promise.race([this.followed, timeout]);
    } finally {
      clearTimeout(timer);
    }
    if (!this.exit) throw this.followError();
    return this.exit;
  }

  /** Sends bytes to the process's stdin (exec with stdin or tty). */
  write(data: Uint8Array | string): Promise<void> {
    return this.box.stdin(this.proc, data, { branch: this.branch });
  }

  /** Closes the process's stdin (it reads EOF). */
  closeStdin(): Promise<void> {
    return this.box.stdin(this.proc, "", { eof: true, branch: this.branch });
  }

  /** Sends a signal by name ("TERM") or number. */
  signal(sig: string | number): Promise<void> {
    return this.box.signal(this.proc, sig, { branch: this.branch });
  }

  /** Sets the pty's size (exec with tty). */
  resize(cols: number, rows: number): Promise<void> {
    return this.box.resize(this.proc, cols, rows, { branch: this.branch });
  }

  /** Stops following the process (it keeps running in the box). */
  async close(): Promise<void> {
    this.stream.close();
    await this.followed;
  }
}
