"""This job's training script is the digits example's, as the installed engine ships it.

Read it in ``engine/examples/train.py``: a plain Client API loop that trains on this site's shard
(its place among the job's sites, at any site name). ``flengine new`` writes a copy to edit.
"""

from engine.examples.train import main

if __name__ == "__main__":
    main()
