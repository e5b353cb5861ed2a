"""03, image selection: choose the image (choice), put it on every node (distribute, with the layer delta of
layerdelta), and put the model on every node (modelcopy). Import the submodules."""
