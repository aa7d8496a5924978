"""Production mode: the server and client daemons, the job store and scheduler, admin sessions.

A project is provisioned into startup kits (`engine.provision`); the server daemon
(`ServerDaemon`, ``flengine server start KIT``) and each site's client daemon (`ClientDaemon`,
``flengine client start KIT``) run until stopped, and admins submit and manage jobs through
`AdminSession` (``flengine admin KIT COMMAND``). Each job runs in job processes of the same
runtime the simulator uses.
"""
