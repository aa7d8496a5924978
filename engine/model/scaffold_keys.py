"""The meta keys SCAFFOLD's server (`engine.workflows.Scaffold`) and clients (`engine.client.ScaffoldClient`) exchange.

Both sides import them from here, the one layer below both, so they cannot drift apart.
"""

#: Meta key of the server's control variate in the task's model (parameter name -> tensor).
C_GLOBAL_KEY = "scaffold_c_global"
#: Meta key of a client's control variate change in its result (parameter name -> tensor).
C_DELTA_KEY = "scaffold_c_delta"
