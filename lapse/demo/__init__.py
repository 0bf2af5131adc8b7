"""What `lapse demo` is made of: the sample runs, their KFP rows, progress, and the view.

`lapse.cli.demo` starts the servers and the pipeline and ties these together.
"""
