#!/usr/bin/env node
'use strict';
/*
 * s3rver as S3 answers a busy node: a first-byte latency on every request and
 * 503 SlowDown past a GET rate per prefix. Run by bench/_shaped_server.py:
 *
 *   node s3rver_shaped.js --modules DIR -d STORE -a ADDRESS -p PORT --bucket NAME
 *       [--key PEM --cert PEM] [--latency-ms 20] [--get-rate 20 --get-burst 20]
 *       [--processes N]
 *
 * S3rver is a Koa application: one middleware put at the front of its stack
 * (app.middleware, composed when the server starts listening) sees every
 * request before s3rver's own logger, XML encoder, router and authentication.
 * It waits out the latency with a timer and either answers the 503 itself or
 * hands the request on; the response body is s3rver's own stream, so no byte
 * of an object passes through this code.
 *
 * GET /__bench/stats answers the counters as JSON (requests, object GETs and
 * HEADs, 503s sent) for the bench to read between runs.
 *
 * --processes N runs N copies of the server in a node cluster sharing one
 * listening socket: one Node.js process answers a thousand GETs in flight too
 * slowly to stand in for S3's fleet (one of them waited past a 60 s deadline).
 * The counters are then each process's own.
 */

const cluster = require('cluster');

const path = require('path');

function parseArgs(argv) {
  const options = { latencyMs: 0, getRate: 0, getBurst: 0, port: 0, processes: 1 };
  const names = {
    '--modules': 'modules',
    '-d': 'directory',
    '-a': 'address',
    '-p': 'port',
    '--bucket': 'bucket',
    '--key': 'key',
    '--cert': 'cert',
    '--latency-ms': 'latencyMs',
    '--get-rate': 'getRate',
    '--get-burst': 'getBurst',
    '--processes': 'processes',
  };
  for (let i = 0; i < argv.length; i += 2) {
    const name = names[argv[i]];
    if (name === undefined || i + 1 >= argv.length) {
      throw new Error(`unknown or incomplete option ${argv[i]}`);
    }
    options[name] = argv[i + 1];
  }
  for (const name of ['port', 'latencyMs', 'getRate', 'getBurst', 'processes']) {
    options[name] = Number(options[name]);
  }
  for (const name of ['modules', 'directory', 'address', 'bucket']) {
    if (!options[name]) throw new Error(`missing option for ${name}`);
  }
  return options;
}

// A token bucket per prefix: `rate` tokens a second, at most `burst` saved up.
class RateLimiter {
  constructor(rate, burst) {
    this.rate = rate;
    this.burst = Math.max(1, burst || Math.ceil(rate));
    this.buckets = new Map();
  }

  allow(prefix, nowMs) {
    let state = this.buckets.get(prefix);
    if (state === undefined) {
      state = { tokens: this.burst, at: nowMs };
      this.buckets.set(prefix, state);
    }
    state.tokens = Math.min(this.burst, state.tokens + ((nowMs - state.at) / 1000) * this.rate);
    state.at = nowMs;
    if (state.tokens >= 1) {
      state.tokens -= 1;
      return true;
    }
    return false;
  }
}

// Path-style requests: /bucket/first-segment/... -> "bucket/first-segment".
function objectPrefix(urlPath) {
  const parts = urlPath.split('?')[0].split('/').filter(part => part.length > 0);
  if (parts.length < 2) return null; // the service or a bucket: no object
  return `${parts[0]}/${parts[1]}`;
}

const SLOW_DOWN =
  '<?xml version="1.0" encoding="UTF-8"?>\n' +
  '<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>' +
  '<RequestId>BENCHSLOWDOWN</RequestId><HostId>bench</HostId></Error>';

function shapingMiddleware(options, stats) {
  const limiter = options.getRate > 0 ? new RateLimiter(options.getRate, options.getBurst) : null;
  return async function shaped(ctx, next) {
    if (ctx.method === 'GET' && ctx.path === '/__bench/stats') {
      ctx.type = 'application/json';
      ctx.body = JSON.stringify(stats);
      return;
    }
    stats.requests += 1;
    if (options.latencyMs > 0) {
      await new Promise(resolve => setTimeout(resolve, options.latencyMs));
    }
    const prefix = objectPrefix(ctx.path);
    if (prefix !== null && (ctx.method === 'GET' || ctx.method === 'HEAD')) {
      stats.objectReads += 1;
      if (limiter !== null && !limiter.allow(prefix, Date.now())) {
        stats.slowDowns += 1;
        ctx.status = 503;
        ctx.set('Retry-After', '1');
        ctx.type = 'application/xml';
        ctx.body = ctx.method === 'HEAD' ? null : SLOW_DOWN;
        return;
      }
    }
    await next();
  };
}

// The cluster's primary: starts the servers, prints the first one's "listening"
// line (they share its port), and takes them down with it.
function runCluster(count) {
  let announced = false;
  for (let i = 0; i < count; i += 1) {
    const worker = cluster.fork();
    worker.on('message', message => {
      if (!announced && message && message.listening) {
        announced = true;
        console.log(message.listening);
      }
    });
  }
  cluster.on('exit', (worker, code) => {
    console.error(`server process ${worker.process.pid} exited (${code})`);
    process.exit(1);
  });
  const stop = () => {
    cluster.removeAllListeners('exit');
    for (const worker of Object.values(cluster.workers)) worker.process.kill('SIGTERM');
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

async function main() {
  const options = parseArgs(process.argv.slice(2));
  if (options.processes > 1 && cluster.isPrimary) {
    runCluster(options.processes);
    return;
  }
  const S3rver = require(path.join(options.modules, 's3rver'));
  const fs = require(path.join(options.modules, 'fs-extra'));
  fs.ensureDirSync(options.directory);
  const serverOptions = {
    directory: options.directory,
    address: options.address,
    port: options.port,
    silent: true,
    configureBuckets: [{ name: options.bucket, configs: [] }],
  };
  if (options.key && options.cert) {
    serverOptions.key = fs.readFileSync(options.key);
    serverOptions.cert = fs.readFileSync(options.cert);
  }
  const server = new S3rver(serverOptions);
  if (!Array.isArray(server.middleware)) {
    throw new Error('s3rver is not a Koa application with a middleware array');
  }
  const stats = { requests: 0, objectReads: 0, slowDowns: 0 };
  server.middleware.unshift(shapingMiddleware(options, stats));
  const { address, port } = await server.run();
  const listening = `S3rver listening on ${address}:${port}`;
  if (cluster.isWorker) {
    process.send({ listening });
    process.on('disconnect', () => process.exit(0)); // the primary is gone
  } else {
    console.log(listening);
  }
  // Open keep-alive connections would hold a graceful close: just go.
  process.on('SIGTERM', () => process.exit(0));
  process.on('SIGINT', () => process.exit(0));
}

main().catch(err => {
  console.error(err);
  process.exit(1);
});
