"""The core: the tree and its pack, masks, log-softmax of rows, checks. torch and numpy only;
imports no other part of treepack."""
