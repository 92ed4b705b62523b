import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, IFrame, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { LabIcon } from '@jupyterlab/ui-components';

import { IPlotLink } from './models';
import { WorkbenchPanel } from './panel';
import { watchWidgetRestores } from './widgets';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
  '<rect x="3" y="14" width="4" height="7"/><rect x="10" y="9" width="4" height="12"/><rect x="17" y="4" width="4" height="17"/>' +
  '</g></svg>';
const workbenchIcon = new LabIcon({ name: 'workbench:clusters', svgstr: ICON_SVG });

namespace CommandIDs {
  export const openPlot = 'workbench:open-plot';
  export const insertConnection = 'workbench:insert-connection-code';
  export const showPanel = 'workbench:show-panel';
}

/** What a plot pane needs to be opened again after a page reload. */
interface IPlotArgs {
  cluster: string;
  name: string;
  title: string;
  path: string;
}

/** The part of BokehJS a pane uses: the documents of its page, and a model's tags. */
interface IBokehWindow extends Window {
  Bokeh?: { documents: { get_model_by_name(name: string): { tags: unknown[] } | null }[] };
}

const PAGE_ROOT = 'workbench_page'; // the root of a served plot's document (dashboard/server.py)

class PlotPane extends MainAreaWidget<IFrame> {
  constructor(readonly plot: IPlotArgs) {
    // Bokeh's page needs its scripts and, for its websocket, this server's cookies (same origin)
    super({ content: new IFrame({ sandbox: ['allow-scripts', 'allow-same-origin'] }) });
    this.id = `workbench-plot-${plot.cluster}-${plot.name}`;
    this.addClass('wb-plot-pane');
    this.title.label = `${plot.cluster} · ${plot.title}`;
    this.title.icon = workbenchIcon;
    this.title.closable = true;
    this.content.url = plot.path;
    const frame = this.content.node.querySelector('iframe');
    frame?.setAttribute('data-cluster', plot.cluster);
    frame?.setAttribute('data-plot', plot.name);
  }

  /** A pane behind another tab asks its page's app to stop updating (BokehJS draws a hidden page as busily). */
  protected onAfterHide(): void {
    this.tagPage(['hidden']);
  }

  protected onAfterShow(): void {
    this.tagPage([]);
  }

  private tagPage(tags: string[]): void {
    const frame = this.content.node.querySelector('iframe');
    const bokeh = (frame?.contentWindow as IBokehWindow | null | undefined)?.Bokeh;
    for (const doc of bokeh?.documents ?? []) {
      const root = doc.get_model_by_name(PAGE_ROOT);
      if (root) {
        root.tags = tags;
      }
    }
  }
}

/** The one line a notebook needs to use a running cluster. */
export function connectionCode(cluster: string): string {
  return `import workbench as wb\ncluster = wb.attach(${JSON.stringify(cluster)})\ncluster`;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-tf-workbench:plugin',
  description: 'Manage workbench clusters and open their live dashboards.',
  autoStart: true,
  optional: [ILayoutRestorer, INotebookTracker, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    notebooks: INotebookTracker | null,
    palette: ICommandPalette | null
  ) => {
    const tracker = new WidgetTracker<PlotPane>({ namespace: 'workbench-plot' });
    if (notebooks) {
      watchWidgetRestores(notebooks); // a dashboard reloaded on a busy page is not left reading "model not found"
    }

    app.commands.addCommand(CommandIDs.openPlot, {
      label: args => `Open ${String(args.title ?? 'plot')} of ${String(args.cluster ?? 'a cluster')}`,
      execute: args => {
        const plot = args as unknown as IPlotArgs;
        const open = tracker.find(pane => pane.id === `workbench-plot-${plot.cluster}-${plot.name}`);
        if (open) {
          app.shell.activateById(open.id);
          return open;
        }
        const pane = new PlotPane(plot);
        void tracker.add(pane);
        app.shell.add(pane, 'main');
        return pane;
      }
    });

    const insertConnectionCode = (cluster: string): string | null => {
      const current = notebooks?.currentWidget;
      if (!current) {
        return 'Open a notebook first: the code goes below its active cell.';
      }
      NotebookActions.insertBelow(current.content);
      current.content.activeCell?.model.sharedModel.setSource(connectionCode(cluster));
      app.shell.activateById(current.id);
      return null;
    };
    app.commands.addCommand(CommandIDs.insertConnection, {
      label: 'Insert workbench connection code',
      execute: args => insertConnectionCode(String(args.cluster))
    });

    const panel = new WorkbenchPanel({
      openPlot: (cluster: string, plot: IPlotLink) =>
        void app.commands.execute(CommandIDs.openPlot, { cluster, name: plot.name, title: plot.title, path: plot.path }),
      insertConnectionCode
    });
    panel.title.icon = workbenchIcon;
    app.shell.add(panel, 'left', { rank: 300 });

    app.commands.addCommand(CommandIDs.showPanel, {
      label: 'Show the Workbench panel',
      // after the layout is restored: run while the page loads, the restored sidebar would hide the panel again
      execute: async () => {
        await app.restored;
        app.shell.activateById(panel.id);
      }
    });
    palette?.addItem({ command: CommandIDs.showPanel, category: 'Workbench' });

    if (restorer) {
      restorer.add(panel, 'workbench-panel');
      void restorer.restore(tracker, {
        command: CommandIDs.openPlot,
        args: pane => ({ ...pane.plot }),
        name: pane => pane.id
      });
    }
  }
};

export default plugin;
