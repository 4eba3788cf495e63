// Run by core.test.mjs under `node --experimental-websocket`: the browser-safe core alone
// (dist/index.js) with the platform's WHATWG WebSocket, as a page uses it: an explicit token in an
// auth frame. Prints what it saw as one JSON line.
import { AuthError, Box } from "../dist/index.js";

const [url, token] = process.argv.slice(2);
const out = { hasWebSocket: typeof globalThis.WebSocket === "function" };
if (out.hasWebSocket) {
  try {
    await Box.connect(url, { token: "not-the-token" });
    out.wrong = "accepted";
  } catch (e) {
    out.wrong = e instanceof AuthError ? e.code : String(e);
  }
  try {
    await Box.connect(url);
  } catch (e) {
    out.none = e instanceof AuthError ? e.message : String(e);
  }
  const box = await Box.connect(url, { token });
  const p = await box.exec(["sh", "-c", "head -c 3 | od -An -tx1; echo done"], { stdin: true });
  await p.write(new Uint8Array([0xff, 0x00, 0xfe]));
  out.exit = (await p.wait(20000)).code;
  out.stdout = new TextDecoder().decode(p.stdout);
  const data = new Uint8Array(3 * 1024 * 1024 + 7).map((_, i) => (i * 7) % 256);
  await box.fs.write("/workspace/core.bin", data);
  const back = await box.fs.read("/workspace/core.bin");
  out.same = back.length === data.length && back.every((b, i) => b === data[i]);
  const s = box.events({ since: 0 });
  out.first = (await s.next()).value.type;
  await box.close();
}
console.log(JSON.stringify(out));
