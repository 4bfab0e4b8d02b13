"""How a network trains: one loop on Lightning Fabric for every training of a run (:mod:`ddcnn.engine.loop`), on one
device or with DDP (spawned, or across the tasks of an ``srun`` step: :mod:`ddcnn.engine.launch`); what the stages call
(:func:`ddcnn.engine.train.fit`), the settings it implements (:mod:`ddcnn.settings.loop`, importable without Fabric),
progress and loggers (:mod:`ddcnn.engine.loggers`), prediction and saved weights (:mod:`ddcnn.engine.common`), and
batch norm over DDP ranks on any device (:mod:`ddcnn.engine.sync_norm`). No module of ddcnn imports the ``lightning``
package (Lightning's Trainer); the engine uses ``lightning_fabric`` alone.
"""
