// The dashboard in a real browser (CTest: dashboard_browser_test, label integration).
//
// Starts a cluster with `tessera start --head` (2 workers) in a fresh session, runs a short
// train_gpt2 on it, opens the URL the head printed in headless Chromium (playwright-core), and
// checks that workers (bound to cores: each shows the CPUs it runs on), memory, the loss plot and
// timeline entries appear and then change, that
// the job history keeps a finished job beside the running one (plan, validation loss), that a
// timeline span names its task on hover, and that the logs view shows a worker's log by its id;
// saves
// a screenshot to bench/results/dashboard_<date>.png; checks that requests without the token get
// 401. No timing thresholds: waits are generous deadlines, never measurements.
//
// Skips (exit 77) with a message when playwright-core (npm install in tests/browser) or Chromium
// is missing. Environment: TESSERA_BIN_DIR (tessera, train_gpt2), TESSERA_SOURCE_DIR,
// CHROMIUM (default: /usr/bin/chromium, then chromium on $PATH).
import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const SKIP = 77;
const binDir = process.env.TESSERA_BIN_DIR;
const sourceDir = process.env.TESSERA_SOURCE_DIR;
if (!binDir || !sourceDir) {
  console.error('dashboard_test: set TESSERA_BIN_DIR and TESSERA_SOURCE_DIR (ctest does)');
  process.exit(1);
}

let chromium;
try {
  ({ chromium } = await import('playwright-core'));
} catch (error) {
  console.log('SKIPPED: playwright-core is not installed (cd tests/browser && npm install, or ' +
              'scripts/install_deps.sh): ' + error.message);
  process.exit(SKIP);
}
function findChromium() {
  const candidates = [process.env.CHROMIUM, '/usr/bin/chromium', '/usr/bin/chromium-browser'];
  for (const dir of (process.env.PATH || '').split(':')) candidates.push(path.join(dir, 'chromium'));
  return candidates.find(c => c && fs.existsSync(c));
}
const chromiumPath = findChromium();
if (!chromiumPath) {
  console.log('SKIPPED: no Chromium found (apt-get install chromium, or set CHROMIUM)');
  process.exit(SKIP);
}

function check(condition, what) {
  if (!condition) throw new Error('check failed: ' + what);
  console.log('ok: ' + what);
}

const session = fs.mkdtempSync(path.join(os.tmpdir(), 'tessera-dashboard-test-'));
const tessera = path.join(binDir, 'tessera');
let training = null;
let browser = null;
let address = null;

async function main() {
  // The cluster: `tessera start --head` prints the dashboard's URL.
  const head = spawnSync(tessera, ['start', '--head', '--session-dir', session, '--port', '0'],
                         { encoding: 'utf8' });
  check(head.status === 0, 'tessera start --head: ' + head.stdout + head.stderr);
  const printed = head.stdout.match(/dashboard: (http:\/\/\S+\/\?token=\S+)/);
  check(printed !== null, 'the head printed the dashboard URL');
  const url = printed[1];
  address = fs.readFileSync(path.join(session, 'scheduler.address'), 'utf8').trim();
  const tokenFile = path.join(session, 'token');
  const workers = spawnSync(tessera, ['start', '--address', address, '--token-file', tokenFile,
                                      '--cpu-workers', '2', '--threads', '1', '--bind-cores'],
                            { encoding: 'utf8' });
  check(workers.status === 0, '2 workers joined: ' + workers.stdout + workers.stderr);

  // Without the token: 401, nothing else.
  const base = url.slice(0, url.indexOf('/?token='));
  for (const route of ['/', '/api/cluster', '/api/job', '/api/timeline', '/api/logs',
                       '/api/logs/scheduler', '/metrics']) {
    const response = await fetch(base + route);
    const body = await response.text();
    check(response.status === 401 && !body.includes(session), 'without the token ' + route + ' is 401');
  }
  const wrong = await fetch(base + '/api/cluster', { headers: { Authorization: 'Bearer nope' } });
  check(wrong.status === 401, 'a wrong token is 401');

  // A first, short job that finishes (the job history keeps it), then a run on the cluster
  // long enough to watch it progress, evaluated every 20 steps.
  const shortJob = spawnSync(path.join(binDir, 'train_gpt2'),
                          ['--preset', 'tiny', '--steps', '3', '--address', address,
                           '--token-file', tokenFile, '--workers', '2'], { encoding: 'utf8' });
  check(shortJob.status === 0, 'a first short job ran: ' + shortJob.stderr.slice(-500));
  training = spawn(path.join(binDir, 'train_gpt2'),
                   ['--preset', 'tiny', '--steps', '100000', '--log-every', '100',
                    '--eval-every', '20', '--eval-batches', '1',
                    '--address', address, '--token-file', tokenFile, '--workers', '2'],
                   { stdio: ['ignore', 'pipe', 'pipe'] });
  let trainingLog = '';
  training.stdout.on('data', d => { trainingLog += d; });
  training.stderr.on('data', d => { trainingLog += d; });
  training.on('exit', code => { if (code !== null && code !== 0) console.error(trainingLog); });

  browser = await chromium.launch({ executablePath: chromiumPath, headless: true,
                                    args: ['--no-sandbox', '--disable-gpu'] });
  const context = await browser.newContext({ viewport: { width: 1400, height: 1300 } });
  const page = await context.newPage();
  const pageErrors = [];
  page.on('pageerror', e => pageErrors.push(String(e)));
  await page.goto(url);
  check(!page.url().includes('token='), 'the token left the address bar (cookie set): ' + page.url());

  const deadline = { timeout: 90_000 };
  await page.waitForFunction(() => document.querySelectorAll('#workers tbody tr').length >= 2, null, deadline);
  check(true, 'workers are listed');
  const memory = await page.locator('#workers tbody tr td.memory').first().textContent();
  check(/\d.* \/ \d/.test(memory), 'a worker shows host memory used / capacity: ' + memory);
  // Bound to cores: each worker's CPU cell names its own CPUs (different ones where the machine
  // has two or more).
  const cpuCells = await page.locator('#workers tbody tr td.cpu').allTextContents();
  const cpuSets = cpuCells.map(text => (text.match(/ on ([0-9,-]+)$/) || [])[1]);
  check(cpuSets.every(set => set !== undefined), 'every worker shows the CPUs it runs on: ' +
        cpuCells.join(' | '));
  // os.availableParallelism (the CPUs this process may use) is Node 18.14's; Debian 12's first
  // nodejs (18.13) has only os.cpus.
  const usable = os.availableParallelism ? os.availableParallelism() : os.cpus().length;
  check(usable < 2 || new Set(cpuSets).size === cpuSets.length,
        'workers bound to cores run on CPUs of their own: ' + cpuCells.join(' | '));
  await page.waitForFunction(() => Number(document.getElementById('plot-loss').dataset.points || 0) >= 2, null, deadline);
  await page.waitForFunction(() => Number(document.getElementById('timeline').dataset.spans || 0) >= 1, null, deadline);
  await page.waitForFunction(() => document.querySelectorAll('#ranks tbody tr').length >= 1, null, deadline);
  const read = () => page.evaluate(() => ({
    lossPoints: Number(document.getElementById('plot-loss').dataset.points),
    lastStep: Number(document.getElementById('plot-loss').dataset.lastStep),
    spans: Number(document.getElementById('timeline').dataset.spans),
    lastEnd: Number(document.getElementById('timeline').dataset.lastEnd),
    kinds: document.getElementById('timeline').dataset.kinds,
    tasksDone: [...document.querySelectorAll('#workers td.tasks-done')].map(td => td.textContent).join(','),
    memory: [...document.querySelectorAll('#workers td.memory')].map(td => td.textContent).join(','),
    job: document.getElementById('job-name').textContent,
  }));
  const first = await read();
  check(first.lossPoints >= 2, 'the loss plot has points: ' + JSON.stringify(first));
  check(first.spans >= 1, 'the timeline has entries');
  check(/forward/.test(first.kinds) && /backward/.test(first.kinds),
        'the timeline tells forward from backward work: ' + first.kinds);
  check(first.job.includes('train_gpt2'), 'the job is named: ' + first.job);
  // Updates: the page polls; wait until the plot and the timeline moved on.
  await page.waitForFunction(
    f => Number(document.getElementById('plot-loss').dataset.lastStep) > f.lastStep &&
         Number(document.getElementById('timeline').dataset.lastEnd) > f.lastEnd,
    first, deadline);
  const second = await read();
  check(second.lastStep > first.lastStep, 'the loss plot updated: step ' + first.lastStep + ' -> ' + second.lastStep);
  check(second.lastEnd > first.lastEnd, 'the timeline updated');

  // The job history: both jobs, the first finished; the latest shown with its plan and its
  // validation losses as dots on the loss plot; picking the first shows it, and no per-rank row
  // of the later job's steps.
  await page.waitForFunction(() => document.querySelectorAll('#jobs tbody tr').length >= 2, null, deadline);
  const jobs = await page.$$eval('#jobs tbody tr', rows => rows.map(r => r.textContent));
  check(jobs.some(r => r.includes('finished')) && jobs.some(r => r.includes('running')),
        'the job history lists the finished job and the running one: ' + jobs.join(' | '));
  check(jobs.every(r => r.includes('data_parallel=2')), 'each job shows its plan: ' + jobs.join(' | '));
  const plan = await page.locator('#job-plan').textContent();
  check(plan.includes('plan: data_parallel=2'), 'the job panel shows the plan: ' + plan);
  await page.waitForFunction(() => Number(document.getElementById('plot-loss').dataset.dots || 0) >= 1, null, deadline);
  check(true, 'the loss plot shows validation losses');
  await page.click('#jobs tbody tr:last-child');  // the oldest job
  await page.waitForFunction(() => document.getElementById('job-name').textContent.includes('finished'), null, deadline);
  await page.waitForFunction(() => document.querySelectorAll('#ranks tbody tr').length === 0, null, deadline);
  check(true, 'the finished job is shown, without the running job\'s per-rank rows');
  await page.click('#jobs tbody tr:first-child');  // back to the running one
  await page.waitForFunction(() => document.querySelectorAll('#ranks tbody tr').length >= 1, null, deadline);

  // Hovering a span of the timeline names its task by rank, layer and op (no numeric ids); the
  // timeline holds still while pointed at. First point at it (a corner: no span there), then at
  // a span as drawn.
  await page.locator('#timeline').scrollIntoViewIfNeeded();
  const box = await page.locator('#timeline').boundingBox();  // in the viewport, once in view
  await page.mouse.move(box.x + 2, box.y + 2);
  const span = await page.evaluate(() => {
    const d = drawnSpans.find(x => x.w >= 3) || drawnSpans[0];
    return { x: d.x + d.w / 2, y: d.y + d.h / 2 };
  });
  const canvasWidth = await page.evaluate(() => document.getElementById('timeline').width);
  const canvasHeight = await page.evaluate(() => document.getElementById('timeline').height);
  await page.mouse.move(box.x + span.x * box.width / canvasWidth, box.y + span.y * box.height / canvasHeight);
  await page.waitForFunction(() => !document.getElementById('timeline-tip').hidden, null, deadline);
  const tip = await page.locator('#timeline-tip').textContent();
  check(/ ms/.test(tip) && /on worker\d+/.test(tip) && !/^\d+\.\d+\//.test(tip),
        'hovering a span names its task: ' + tip.replace(/\n/g, ' | '));

  // The logs view: a button per log of the session (the scheduler's, each worker's by the id
  // the workers table shows); picking a worker's shows the end of its log.
  await page.waitForFunction(
    () => [...document.querySelectorAll('#logs button')].filter(b => /^worker[0-9]+$/.test(b.dataset.name)).length >= 2,
    null, deadline);
  const names = await page.$$eval('#logs button', buttons => buttons.map(b => b.dataset.name));
  check(names.includes('scheduler'), 'the logs view lists the scheduler and the workers by id: ' + names.join(','));
  const workerLog = names.find(n => /^worker[0-9]+$/.test(n));
  await page.click(`#logs button[data-name="${workerLog}"]`);
  await page.waitForFunction(
    n => document.getElementById('log-text').dataset.name === n &&
         document.getElementById('log-text').textContent.includes(n + ' joined'),
    workerLog, deadline);
  check(true, 'picking ' + workerLog + ' shows the end of its log');
  const missing = await page.evaluate(async () => (await fetch('/api/logs/worker999')).status);
  check(missing === 404, 'an unknown log is 404');

  // GPU utilisation per worker: a GPU worker (the simulated GPU: this machine may have none)
  // joins; its row shows its GPU busy and its memory used / total, the CPU workers' show '-'.
  const gpuWorker = spawnSync(tessera, ['start', '--address', address, '--token-file', tokenFile,
                                        '--gpus', '0', '--threads', '1'],
                              { encoding: 'utf8', env: { ...process.env, TESSERA_SIMULATED_GPU: '1' } });
  check(gpuWorker.status === 0, 'a GPU worker joined: ' + gpuWorker.stdout + gpuWorker.stderr);
  await page.waitForFunction(
    () => [...document.querySelectorAll('#workers td.gpu-use')].some(td => /%/.test(td.textContent)),
    null, deadline);
  const gpuCells = await page.$$eval('#workers td.gpu-use', tds => tds.map(td => td.textContent));
  check(gpuCells.filter(t => /^\d+%, .+ \/ 64\.0 GiB$/.test(t)).length === 1 &&
        gpuCells.filter(t => t === '-').length === gpuCells.length - 1,
        'the GPU worker shows its GPU busy and memory, the CPU workers none: ' + gpuCells.join(' | '));

  const date = new Date().toISOString().slice(0, 10);
  const results = path.join(sourceDir, 'bench', 'results');
  fs.mkdirSync(results, { recursive: true });
  const shot = path.join(results, `dashboard_${date}.png`);
  await page.screenshot({ path: shot, fullPage: true });
  check(fs.statSync(shot).size > 0, 'screenshot saved: ' + shot);

  // A second browser without the cookie is refused too.
  const stranger = await browser.newContext();
  const strangerPage = await stranger.newPage();
  const refused = await strangerPage.goto(base + '/');
  check(refused.status() === 401, 'a browser without the token gets 401');
  check(pageErrors.length === 0, 'no script errors on the page: ' + pageErrors.join('; '));
}

let failed = false;
try {
  await main();
} catch (error) {
  failed = true;
  console.error('FAILED: ' + (error.stack || error));
} finally {
  if (browser) await browser.close().catch(() => {});
  if (training && training.exitCode === null) training.kill('SIGTERM');
  if (address) {
    spawnSync(tessera, ['stop', '--address', address, '--token-file', path.join(session, 'token')],
              { encoding: 'utf8' });
  }
  if (failed) {
    for (const log of fs.readdirSync(session).filter(f => f.endsWith('.log'))) {
      console.error('--- ' + log + ' ---\n' + fs.readFileSync(path.join(session, log), 'utf8').slice(-3000));
    }
  } else {
    fs.rmSync(session, { recursive: true, force: true });
  }
}
process.exit(failed ? 1 : 0);
