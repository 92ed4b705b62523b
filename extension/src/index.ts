import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'workbench-labextension:plugin',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    console.log('workbench panel', app.name);
  }
};
export default plugin;
