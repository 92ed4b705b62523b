import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { jsonInit, requestAPI } from './api';
import { IClusterInfo, IJobNow, IPlotLink, IStartForm } from './models';

/** What the panel asks of the application (commands live in index.ts). */
export interface IPanelActions {
  openPlot(cluster: string, plot: IPlotLink): void;
  insertConnectionCode(cluster: string): string | null; // an error message, or null when inserted
}

const IDLE_MS = 2000; // a card's figures while no job runs on its cluster
const LIVE_MS = 500; // while one runs, is stopping or waits in the queue
const RETRY_MS = 2000; // after the list could not be read
const SPARK_POINTS = 60;
const ACTIVE_STATES = ['running', 'stopping', 'queued'];
// the plots' buttons, short enough for one row at the sidebar's default width (the full title is the tooltip)
const PLOT_LABELS: Record<string, string> = {
  dashboard: 'All',
  timeline: 'Timeline',
  throughput: 'Rates',
  progress: 'Progress',
  profile: 'Profile'
};
const PLOT_ORDER = ['dashboard', 'timeline', 'throughput', 'progress', 'profile'];

/** A figure where space is short: 812, 13.1k, 2.4M (and 0.5 for small rates). */
export function compact(value: number): string {
  const size = Math.abs(value);
  if (size >= 1e6) {
    return `${(value / 1e6).toFixed(1)}M`;
  }
  if (size >= 1e3) {
    return `${(value / 1e3).toFixed(1)}k`;
  }
  return size >= 10 || value === 0 ? value.toFixed(0) : value.toFixed(1);
}

/** Seconds as people read them: 3.1 s, 42 s, 2 min 05 s. */
export function duration(seconds: number): string {
  if (seconds < 10) {
    return `${seconds.toFixed(1)} s`;
  }
  if (seconds < 60) {
    return `${seconds.toFixed(0)} s`;
  }
  const minutes = Math.floor(seconds / 60);
  return `${minutes} min ${String(Math.round(seconds - 60 * minutes)).padStart(2, '0')} s`;
}

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => window.setTimeout(resolve, ms));
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Record<string, string> = {},
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    node.setAttribute(key, value);
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** The left-sidebar panel: the clusters the server lists, a form to start one, and their plots. */
export class WorkbenchPanel extends Widget {
  private readonly list = el('div', { class: 'wb-clusters' });
  private readonly status = el('div', { class: 'wb-status', role: 'status' });
  private readonly cards = new Map<string, ClusterCard>();
  private readonly form: StartForm;
  private version = ''; // of the list drawn: the server answers a watch when its list differs
  private watching = 0; // the watch loop's generation: a new loop ends the one before
  private startedHere: string | null = null; // the cluster the form started last: its message goes with it

  constructor(private readonly actions: IPanelActions) {
    super();
    this.id = 'workbench-panel';
    this.addClass('wb-panel');
    this.title.caption = 'Workbench: clusters and dashboards';
    const header = el('div', { class: 'wb-header' });
    header.append(el('h2', {}, 'Workbench clusters'));
    this.form = new StartForm(
      message => this.say(message.text, message.error),
      name => {
        this.startedHere = name;
        return this.refresh();
      }
    );
    this.node.append(header, this.form.node, this.status, this.list);
  }

  /** One status line: the form's feedback, or why the list could not be read (`source`). */
  say(text: string, error = false, source = 'form'): void {
    this.status.textContent = text;
    this.status.classList.toggle('wb-error', error);
    this.status.dataset.source = source;
  }

  protected onAfterAttach(): void {
    void this.watch();
  }

  protected onAfterShow(): void {
    void this.watch(); // at once when the user opens the panel
  }

  protected onBeforeDetach(): void {
    this.watching++;
    for (const card of this.cards.values()) {
      card.dispose();
    }
    this.cards.clear();
    this.list.replaceChildren();
  }

  /**
   * Follow the server's list while the panel is shown: each request is answered as soon as the list
   * differs from the one drawn (a cluster starting, a job beginning or ending, a task lost), so the
   * panel learns of it within a fraction of a second without polling fast.
   */
  private async watch(): Promise<void> {
    const generation = ++this.watching;
    this.version = ''; // the first answer comes at once
    while (generation === this.watching && this.isAttached && this.isVisible) {
      try {
        const body = await requestAPI<{ clusters: IClusterInfo[]; version: string }>(
          `clusters?after=${encodeURIComponent(this.version)}`
        );
        if (generation !== this.watching) {
          return;
        }
        this.draw(body.clusters, body.version);
      } catch (error) {
        this.say(`Could not list clusters: ${errorText(error)}`, true, 'list');
        await sleep(RETRY_MS);
      }
    }
  }

  /** Ask the server for the clusters now and redraw (after an action taken from the panel). */
  async refresh(): Promise<void> {
    try {
      const body = await requestAPI<{ clusters: IClusterInfo[]; version: string }>('clusters');
      this.draw(body.clusters, body.version);
    } catch (error) {
      this.say(`Could not list clusters: ${errorText(error)}`, true, 'list');
    }
  }

  private draw(clusters: IClusterInfo[], version: string): void {
    this.version = version;
    this.render(clusters);
    if (this.status.dataset.source === 'list') {
      this.say('');
    }
  }

  private render(clusters: IClusterInfo[]): void {
    const names = new Set(clusters.map(c => c.name));
    for (const [name, card] of this.cards) {
      if (!names.has(name)) {
        card.dispose();
        card.node.remove();
        this.cards.delete(name);
      }
    }
    if (this.startedHere && !names.has(this.startedHere)) {
      // the cluster the form started went: its "started" message goes too
      this.startedHere = null;
      if (this.status.dataset.source === 'form' && !this.status.classList.contains('wb-error')) {
        this.say('');
      }
    }
    // the clusters with a job running first (the one being watched stays in sight), then by name
    const ordered = [...clusters.filter(c => c.job), ...clusters.filter(c => !c.job)];
    // a card is not moved while the user types in the list: moving a node takes the focus from its field
    const typing = this.list.contains(document.activeElement) && document.activeElement instanceof HTMLInputElement;
    ordered.forEach((info, position) => {
      let card = this.cards.get(info.name);
      if (!card) {
        card = new ClusterCard(info.name, this.actions, () => this.refresh());
        this.cards.set(info.name, card);
        this.list.append(card.node);
      }
      const there = this.list.children[position] ?? null;
      if (!typing && there !== card.node) {
        this.list.insertBefore(card.node, there);
      }
      card.update(info);
    });
    if (!clusters.length) {
      this.list.replaceChildren(
        el('p', { class: 'wb-empty' }, 'No cluster runs. Start one above, or from a notebook: wb.Cluster(ps=1, workers=2).start()')
      );
    } else {
      this.list.querySelector('.wb-empty')?.remove();
    }
  }
}

/** The "new cluster" form: fields as in `StartForm` (Python), choices from `/options`. */
class StartForm {
  readonly node = el('details', { class: 'wb-start' });
  private readonly engines = el('select', { name: 'engines' });
  private readonly profile = el('select', { name: 'profile' });

  constructor(
    private readonly say: (message: { text: string; error: boolean }) => void,
    private readonly started: (name: string) => Promise<void>
  ) {
    this.node.append(el('summary', {}, 'New cluster'));
    const form = el('form', { class: 'wb-start-form' });
    const field = (label: string, input: HTMLElement) => {
      const row = el('label', {}, label);
      row.append(input);
      form.append(row);
    };
    field('ps tasks', el('input', { name: 'ps', type: 'number', min: '0', max: '64', value: '1' }));
    field('workers', el('input', { name: 'workers', type: 'number', min: '1', max: '64', value: '2' }));
    field('GPUs per worker', el('input', { name: 'gpus_per_worker', type: 'number', min: '0', max: '64', value: '0' }));
    field('launcher', this.engines);
    field('ipyparallel profile', this.profile);
    field('name (optional)', el('input', { name: 'name', type: 'text', placeholder: 'wb-…' }));
    // the launcher's main options (what a batch site or other hosts need); none for local engines
    const site = el('details', { class: 'wb-start-site' });
    site.append(el('summary', {}, 'Launcher options'));
    form.append(site);
    const option = (label: string, name: string, placeholder: string) => {
      const row = el('label', {}, label);
      row.append(el('input', { name, type: 'text', placeholder }));
      site.append(row);
    };
    option('controller address', 'controller_ip', 'an address the engines reach');
    option('queue', 'queue', 'batch launchers: partition');
    option('account', 'account', 'batch launchers');
    option('time limit', 'timelimit', 'HH:MM:SS');
    const others = el('label', {}, 'other options (KEY=VALUE, one a line)');
    others.append(el('textarea', { name: 'options', rows: '3', placeholder: "hosts={'node1': 2}" }));
    site.append(others);
    const start = el('button', { type: 'submit', class: 'jp-mod-styled jp-mod-accept wb-start-button' }, 'Start');
    form.append(start);
    form.addEventListener('submit', event => {
      event.preventDefault();
      void this.submit(form, start);
    });
    this.node.append(form);
    this.node.addEventListener('toggle', () => void this.loadOptions(), { once: true });
  }

  private async loadOptions(): Promise<void> {
    try {
      const options = await requestAPI<{ engines: string[]; profiles: string[] }>('options');
      this.engines.replaceChildren(...options.engines.map(e => el('option', { value: e }, e)));
      this.profile.replaceChildren(
        el('option', { value: '' }, '(default)'),
        ...options.profiles.map(p => el('option', { value: p }, p))
      );
    } catch (error) {
      this.say({ text: `Could not read the launchers: ${errorText(error)}`, error: true });
    }
  }

  private async submit(form: HTMLFormElement, button: HTMLButtonElement): Promise<void> {
    const data = new FormData(form);
    const number = (key: string) => Number(data.get(key));
    const body: IStartForm = {
      ps: number('ps'),
      workers: number('workers'),
      gpus_per_worker: number('gpus_per_worker'),
      engines: String(data.get('engines') || 'local'),
      profile: String(data.get('profile') || ''),
      name: String(data.get('name') || '') || null,
      controller_ip: String(data.get('controller_ip') || '').trim(),
      queue: String(data.get('queue') || '').trim(),
      account: String(data.get('account') || '').trim(),
      timelimit: String(data.get('timelimit') || '').trim(),
      options: String(data.get('options') || '')
    };
    button.disabled = true;
    this.say({ text: 'Starting a cluster: engines, then one TensorFlow server each…', error: false });
    try {
      const info = await requestAPI<IClusterInfo>('clusters', jsonInit('POST', body));
      this.say({ text: `Cluster ${info.name} started (${info.tasks.length} tasks).`, error: false });
      this.node.open = false; // its card is below: the form folds away until the next one
      await this.started(info.name);
    } catch (error) {
      this.say({ text: `Could not start the cluster: ${errorText(error)}`, error: true });
    } finally {
      button.disabled = false;
    }
  }
}

/** One cluster: tasks, its job's figures, plot buttons, connection code, scale and stop. */
class ClusterCard {
  readonly node: HTMLElement;
  private readonly heading = el('div', { class: 'wb-card-heading' });
  private readonly links = el('div', { class: 'wb-links' }); // the emulated links' shaping (network=)
  private readonly tasks = el('table', { class: 'wb-tasks' });
  private readonly live = el('div', { class: 'wb-live' });
  private readonly spark = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  private readonly plots = el('div', { class: 'wb-plots' });
  private readonly feedback = el('div', { class: 'wb-feedback', role: 'status' });
  private readonly workers = el('input', { type: 'number', min: '1', max: '64', class: 'wb-workers' });
  private readonly rates: number[] = [];
  private plotsLoaded = false;
  private busy = false;
  private workersEdited = false; // the user typed a count: refreshes must not overwrite it before Scale
  private controllable = false;
  private recordJob: string | null = null; // the job the registry says runs ('' for none)
  private active = false; // a job runs, stops or waits: its figures are asked for every LIVE_MS
  private liveTimer: number | undefined;
  private fetching = false;
  private disposed = false;

  constructor(
    private readonly name: string,
    private readonly actions: IPanelActions,
    private readonly changed: () => Promise<void>
  ) {
    this.node = el('section', { class: 'wb-card', 'data-cluster': name });
    this.spark.setAttribute('class', 'wb-spark');
    this.spark.setAttribute('viewBox', `0 0 ${SPARK_POINTS} 20`);
    this.spark.setAttribute('preserveAspectRatio', 'none');
    const actionsRow = el('div', { class: 'wb-actions' });
    const insert = el(
      'button',
      { class: 'jp-mod-styled wb-insert', title: 'Insert the code that uses this cluster into the notebook' },
      'Code'
    );
    insert.addEventListener('click', () => {
      const problem = this.actions.insertConnectionCode(this.name);
      this.tell(problem ?? 'Inserted into the notebook below the active cell.', problem !== null);
    });
    const scale = el('button', { class: 'jp-mod-styled wb-scale' }, 'Scale');
    scale.addEventListener('click', () => void this.scale());
    const stop = el('button', { class: 'jp-mod-styled jp-mod-warn wb-stop' }, 'Stop');
    stop.addEventListener('click', () => void this.stop());
    this.workers.addEventListener('input', () => {
      this.workersEdited = true;
    });
    const workersLabel = el('label', { class: 'wb-workers-label' }, 'workers ');
    workersLabel.append(this.workers);
    actionsRow.append(insert, workersLabel, scale, stop);
    this.node.append(this.heading, this.links, this.tasks, this.live, this.spark, this.plots, actionsRow, this.feedback);
  }

  /** The card is gone (its cluster, or the panel): no more requests for it. */
  dispose(): void {
    this.disposed = true;
    window.clearTimeout(this.liveTimer);
  }

  update(info: IClusterInfo): void {
    const owner = info.owned_here ? 'started from this panel' : `owner pid ${info.client_pid}`;
    this.node.dataset.state = info.state;
    this.heading.replaceChildren(
      el('span', { class: 'wb-name' }, info.name),
      el('span', { class: `wb-state wb-state-${info.state}` }, info.state),
      el('span', { class: 'wb-owner' }, `${info.engines} · ${owner}`)
    );
    this.links.textContent = info.network ? `links: ${info.network}` : '';
    this.links.hidden = !info.network;
    this.drawTasks(info);
    if (!this.workersEdited && document.activeElement !== this.workers && !this.busy) {
      this.workers.value = String(info.tasks.filter(t => t.job === 'worker').length);
    }
    const why = info.state === 'starting' ? 'It is starting' : 'Its owner has no control endpoint: act on it from the owner';
    for (const button of this.node.querySelectorAll<HTMLButtonElement>('.wb-scale, .wb-stop')) {
      button.disabled = this.busy || !info.controllable;
      button.title = info.controllable ? '' : why;
    }
    this.controllable = info.controllable;
    if (!info.controllable) {
      this.live.textContent = info.state === 'starting' ? 'Starting: engines, then one TensorFlow server each…' : '';
      return;
    }
    if (!this.plotsLoaded) {
      void this.loadPlots();
    }
    if (info.job !== this.recordJob) {
      this.recordJob = info.job; // a job began or ended: its figures now, then every LIVE_MS while it runs
      this.active = this.active || info.job !== '';
      void this.refreshLive();
    } else if (this.liveTimer === undefined && !this.fetching) {
      void this.refreshLive();
    }
  }

  private drawTasks(info: IClusterInfo): void {
    const head = el('tr');
    for (const title of ['task', 'address', 'health']) {
      head.append(el('th', {}, title));
    }
    const rows = info.tasks.flatMap(task => {
      const row = el('tr', { 'data-task': task.name });
      const devices = task.devices.map(d => d.split('/device:')[1] ?? d).join(', ');
      const health = task.restarts > 0 ? `${task.state}, re-hosted ${task.restarts}x` : task.state;
      row.append(el('td', {}, task.name), el('td', {}, task.address), el('td', {}, health));
      const cell = row.lastElementChild as HTMLElement | null;
      cell?.classList.add(`wb-health-${task.state}`);
      if (cell && task.note) {
        cell.title = task.note; // why: "its engine exited", "not answering", "re-hosted on engine 3"
      }
      // three columns fit the sidebar at 300 px: the engine and devices take a line of their own under them
      const line = `engine ${task.engine_id} · ${devices || '—'}`;
      const sub = el('td', { class: 'wb-sub', colspan: '3', title: line }, line);
      const under = el('tr', { class: 'wb-task-sub', 'data-task-of': task.name });
      under.append(sub);
      return [row, under];
    });
    this.tasks.replaceChildren(head, ...rows);
    this.tasks.hidden = info.tasks.length === 0;
  }

  private tell(text: string, error = false): void {
    this.feedback.textContent = text;
    this.feedback.classList.toggle('wb-error', error);
  }

  private async loadPlots(): Promise<void> {
    this.plotsLoaded = true;
    try {
      const body = await requestAPI<{ plots: IPlotLink[] }>(`clusters/${encodeURIComponent(this.name)}/plots`);
      const rank = (name: string) => (PLOT_ORDER.includes(name) ? PLOT_ORDER.indexOf(name) : PLOT_ORDER.length);
      this.plots.replaceChildren(
        ...[...body.plots].sort((a, b) => rank(a.name) - rank(b.name)).map(plot => {
          const button = el(
            'button',
            { class: 'jp-mod-styled wb-plot', 'data-plot': plot.name, title: `Open ${plot.title}` },
            PLOT_LABELS[plot.name] ?? plot.title
          );
          button.addEventListener('click', () => this.actions.openPlot(this.name, plot));
          return button;
        })
      );
    } catch (error) {
      this.plotsLoaded = false; // try again on the next refresh
      this.plots.replaceChildren(el('span', { class: 'wb-error' }, `Plots unavailable: ${errorText(error)}`));
    }
  }

  /** The newest job's figures, then again in LIVE_MS while a job runs (IDLE_MS otherwise). */
  private async refreshLive(): Promise<void> {
    window.clearTimeout(this.liveTimer);
    this.liveTimer = undefined;
    if (this.disposed || this.fetching || !this.controllable) {
      return;
    }
    this.fetching = true;
    try {
      if (this.node.offsetParent !== null) {
        // shown: the panel hidden asks nothing
        const job = (await requestAPI<{ job: IJobNow | null }>(`clusters/${encodeURIComponent(this.name)}/summary`)).job;
        this.drawJob(job);
      }
    } catch {
      // the list's watch reports a cluster that went away
    } finally {
      this.fetching = false;
      if (!this.disposed && this.controllable) {
        this.liveTimer = window.setTimeout(() => void this.refreshLive(), this.active ? LIVE_MS : IDLE_MS);
      }
    }
  }

  private drawJob(job: IJobNow | null): void {
    this.active = this.recordJob !== '' && this.recordJob !== null;
    if (!job) {
      this.live.replaceChildren(el('div', { class: 'wb-job' }, 'No job yet'));
      return;
    }
    const running = ACTIVE_STATES.includes(job.state);
    this.active = this.active || running || job.queued.length > 0 || job.running.length > 0;
    const rate = el('div', { class: 'wb-rate', 'data-value': String(job.examples_per_s), title: `${job.examples_per_s.toLocaleString(undefined, { maximumFractionDigits: 0 })} examples/s` });
    rate.append(
      `${compact(job.examples_per_s)} ex/s`,
      el('span', { class: 'wb-rate-note' }, running ? ` · ${compact(job.steps_per_s)} steps/s` : ' average')
    );
    const name = el('span', { class: 'wb-jobname', title: job.job }, job.job);
    const line = el('div', { class: 'wb-job' });
    const done = running
      ? ` ${job.state} · ${job.steps_done}/${job.steps_total} steps · ${duration(job.elapsed_s)}`
      : ` ${job.state} · ${job.steps_done}/${job.steps_total} steps in ${duration(job.elapsed_s)}`;
    line.append(name, done);
    this.live.replaceChildren(
      rate,
      line,
      ...(job.running ?? []).map(text => el('div', { class: 'wb-queued' }, `also running: ${text}`)),
      ...(job.queued ?? []).map(text => el('div', { class: 'wb-queued' }, `queued: ${text}`))
    );
    if (running) {
      this.rates.push(job.examples_per_s);
      this.rates.splice(0, Math.max(0, this.rates.length - SPARK_POINTS));
    }
    const top = Math.max(...this.rates, 1e-9);
    const points = this.rates.map((r, i) => `${i + SPARK_POINTS - this.rates.length},${(20 - (18 * r) / top).toFixed(1)}`);
    const polyline = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
    polyline.setAttribute('points', points.join(' '));
    this.spark.replaceChildren(polyline);
  }

  private async scale(): Promise<void> {
    const workers = Number(this.workers.value);
    this.busy = true;
    this.tell(`Scaling to ${workers} worker(s)…`);
    try {
      const info = await requestAPI<IClusterInfo>(`clusters/${encodeURIComponent(this.name)}`, jsonInit('PATCH', { workers }));
      this.tell(`Now ${info.tasks.filter(t => t.job === 'worker').length} worker(s).`);
    } catch (error) {
      this.tell(`Could not scale: ${errorText(error)}`, true);
    } finally {
      this.busy = false;
      this.workersEdited = false; // from now on the field shows the cluster's count again
      await this.changed();
    }
  }

  private async stop(): Promise<void> {
    const answer = await showDialog({
      title: `Stop cluster ${this.name}?`,
      body: 'Its engines and TensorFlow servers stop; a notebook using it loses its cluster.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (!answer.button.accept) {
      return;
    }
    this.busy = true;
    this.tell('Stopping…');
    try {
      await requestAPI(`clusters/${encodeURIComponent(this.name)}`, jsonInit('DELETE'));
      this.tell('Stopped.');
    } catch (error) {
      this.tell(`Could not stop: ${errorText(error)}`, true);
    } finally {
      this.busy = false;
      await this.changed();
    }
  }
}
