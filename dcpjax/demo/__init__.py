"""`python -m dcpjax.demo`: one layer's DCP decode attention against no DCP (`__main__`)."""
