"""Runtime: everything the decode loop needs. Never imports yggtree.offline."""
